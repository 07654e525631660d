"""Checkpoint loaders, one module per format: `safetensors` (Hugging Face and MLX-quantized
layouts, through mlx-lm) and `gguf` (llama.cpp's files). mlx-vlm and Whisper loaders belong beside
them."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def is_gguf(model: object) -> bool:
    """Whether `model` is the path of a GGUF file (what `gguf.load` reads)."""
    if not isinstance(model, (str, Path)):
        return False
    path = Path(model).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


def parameter_bytes(model: Any) -> int:
    """Bytes of every parameter of an MLX module (packed quantized weights as stored)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
