"""Checkpoint loaders, one module per format: `safetensors` (Hugging Face and MLX-quantized
layouts, through mlx-lm) and `gguf` (llama.cpp's files); the helpers below load checkpoints
into model trees written here (encoders, Whisper) strictly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx


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


def read_safetensors(path: Path) -> dict[str, tuple[mx.array, str]]:
    """Every tensor of the folder's `*.safetensors` files -> (tensor, file name)."""
    import mlx.core as mx

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    tensors: dict[str, tuple[mx.array, str]] = {}
    for file in files:
        for name, value in mx.load(str(file)).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {tensors[name][1]} and {file.name}")
            tensors[name] = (value, file.name)
    return tensors


def load_strict(
    model: Any,
    tensors: dict[str, tuple[mx.array, str]],
    *,
    path: Path,
    what: str,
    dtype_of: Callable[[str], mx.Dtype],
) -> None:
    """Load `tensors` (named as `model`'s parameters) into `model`: a missing, unexpected or
    misshapen tensor is a ValueError naming it; floating tensors are cast to `dtype_of(name)`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    if missing := sorted(expected.keys() - tensors.keys()):
        files = sorted({file for _, file in tensors.values()})
        raise ValueError(f"{what} needs tensors {missing} that {path} ({files}) lacks")
    if unexpected := sorted(tensors.keys() - expected.keys()):
        where = [f"{name!r} in {tensors[name][1]}" for name in unexpected]
        raise ValueError(f"{what} has no place for tensors in {path}: {', '.join(where)}")
    weights = []
    for name, (value, file) in tensors.items():
        if value.shape != expected[name].shape:
            raise ValueError(
                f"tensor {name!r} in {Path(path) / file} has shape {value.shape}, "
                f"expected {expected[name].shape}"
            )
        if mx.issubdtype(value.dtype, mx.floating):
            value = value.astype(dtype_of(name))
        weights.append((name, value))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
