"""Checkpoint loaders, one module per format: `safetensors` (Hugging Face and MLX-quantized
layouts, through mlx-lm). GGUF, mlx-vlm and Whisper loaders belong beside it."""

from __future__ import annotations

from typing import Any


def parameter_bytes(model: Any) -> int:
    """Bytes of every parameter of an MLX module (packed quantized weights as stored)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
