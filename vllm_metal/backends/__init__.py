"""Compute backends: each supplies the device facts and the model runner the worker drives.

`VLLM_METAL_BACKEND` picks one (`mlx` is the default); `protocol.py` states what a backend and
its runner provide. Nothing here imports a backend library at module level:
`vllm_metal.backends.mlx` must stay importable before `mlx.core` is (the CPU BLAS is set up
first).
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import TYPE_CHECKING

from vllm_metal import envs

if TYPE_CHECKING:
    from vllm_metal.backends.protocol import Backend

# VLLM_METAL_BACKEND value -> "module:attribute" of its Backend.
BACKENDS = {
    "mlx": "vllm_metal.backends.mlx.device:MLX_BACKEND",
    "mps": "vllm_metal.backends.torch.device:TORCH_BACKEND",
}


class BackendUnavailableError(ValueError):
    """The selected backend is not part of this build."""


def backend_name() -> str:
    return envs.VLLM_METAL_BACKEND


@cache
def _load(name: str) -> Backend:
    module, attr = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def get_backend(name: str | None = None) -> Backend:
    name = name or backend_name()
    if name not in BACKENDS:
        raise BackendUnavailableError(
            f"VLLM_METAL_BACKEND={name!r}: this build has no {name!r} backend; "
            f"available: {', '.join(sorted(BACKENDS))}"
        )
    return _load(name)
