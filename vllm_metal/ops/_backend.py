"""Which implementation the ops run: the compiled extension when it loads for this MLX and can run
on the default device, otherwise (or with VLLM_METAL_USE_REFERENCE_OPS=1) the pure-MLX ones, with
CUDA kernels for some calls on MLX's CUDA GPU; and the opt-in value checks."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from vllm_metal import envs
from vllm_metal._logging import init_logger

logger = init_logger("vllm_metal.ops")

# Held under another name than the submodule, so that after a failed load a direct
# `from vllm_metal.ops import _native` retries the import and shows its error.
try:
    from vllm_metal.ops import _native as _native_ops
except ImportError as exc:
    _native_ops = None
    _NATIVE_ERROR: str | None = str(exc)
    logger.warning("vllm-metal native ops unavailable, using the pure-MLX reference ops: %s", exc)
else:
    _NATIVE_ERROR = None

_value_checks = False


def loaded_native() -> ModuleType | None:
    """The native module when it loaded (whatever VLLM_METAL_USE_REFERENCE_OPS says)."""
    return _native_ops


def native() -> ModuleType | None:
    """The native module the next call uses, or None when it runs the pure-MLX ops: asked for,
    or the default device is a GPU its kernels are not built for (MLX's CUDA backend)."""
    if _native_ops is None or envs.VLLM_METAL_USE_REFERENCE_OPS:
        return None
    if not _native_ops.HAS_METAL and mx.default_device() == mx.gpu:
        return None
    return _native_ops


def cuda_kernels() -> bool:
    """Whether the ops may run their CUDA kernels (`ops/attention/cuda.py`): the default device
    is MLX's CUDA GPU (the GPU proxy) and the reference ops are not asked for."""
    from vllm_metal.ops.attention import cuda

    return not envs.VLLM_METAL_USE_REFERENCE_OPS and cuda.available()


def native_for(size: object, sizes: str = "HEAD_SIZES") -> ModuleType | None:
    """``native()`` for one call with that kernel size. The C++ CPU bodies take any size; the Metal
    kernels only those of the size list ``sizes`` of ``_constants`` (``HEAD_SIZES`` for the
    attention ops, ``MLA_SIZES`` (latent_dim, value_dim) pairs for MLA), so a call that would run
    on the GPU with another size runs the reference instead (MLX's own ops, on the GPU too)."""
    from vllm_metal.ops import _constants  # it reads the constants through this module

    mod = native()
    if mod is not None and size not in getattr(_constants, sizes) and mod.on_gpu():
        return None
    return mod


def native_available() -> bool:
    """True when the compiled extension is importable and matches the installed MLX."""
    return _native_ops is not None


def native_unavailable_reason() -> str | None:
    """Why the extension could not be used (None when it can)."""
    return _NATIVE_ERROR


def backend() -> str:
    """``"native"`` or ``"reference"``: the implementation the next call will use."""
    return "reference" if native() is None else "native"


def set_value_checks(enabled: bool) -> None:
    """Also validate index values (slot range, block ids, sequence lengths) on every call.

    This reads the index arrays on the host, so it synchronises; meant for tests and debugging.
    """
    global _value_checks
    _value_checks = bool(enabled)


def value_checks() -> bool:
    return _value_checks
