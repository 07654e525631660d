"""Reading a target checkpoint's multi-token-prediction tensors, which mlx-lm drops when it loads
the target: the tensors a renaming keeps, read only from the safetensors files that hold them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx


def read_renamed(model_dir: Path, rename: Callable[[str], str | None]) -> dict[str, mx.array]:
    """The checkpoint's tensors for which `rename` gives a name, under that name."""
    from vllm_metal.models.loaders.safetensors import tensor_files

    files = tensor_files(model_dir)
    wanted = {name: new for name in files if (new := rename(name)) is not None}
    weights: dict[str, mx.array] = {}
    for path in sorted({files[n] for n in wanted}):
        tensors = mx.load(str(path))
        weights |= {wanted[n]: v for n, v in tensors.items() if n in wanted}
    return weights
