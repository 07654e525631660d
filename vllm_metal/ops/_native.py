"""Loader of the compiled extension ``vllm_metal._C``, checked against the MLX installed here.

Importing this module raises ImportError, with the reason and the fix, when the extension is not
built, was built for another MLX or ops ABI, or cannot exchange arrays with ``mlx.core``.
"""

from __future__ import annotations

import re

import mlx.core as mx  # loads libmlx before the extension that links against it

# Must equal VLLM_METAL_OPS_ABI in csrc/bindings.cpp.
OPS_ABI = 1

_REBUILD = (
    "rebuild it with `pip install -e . --no-build-isolation --no-deps` (or reinstall vllm-metal) "
    "in this environment, or set VLLM_METAL_USE_REFERENCE_OPS=1 to run the pure-MLX ops"
)


def _release(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(p) for p in match.groups()) if match else ()


try:
    from vllm_metal import _C
except ImportError as exc:
    raise ImportError(
        f"the native extension vllm_metal._C is not available ({exc}); {_REBUILD}"
    ) from exc

if _release(_C.MLX_VERSION) != _release(mx.__version__):
    raise ImportError(
        f"vllm_metal._C was built against MLX {_C.MLX_VERSION} but MLX {mx.__version__} is "
        f"installed; an extension only works with the MLX it was built with: {_REBUILD}"
    )
if getattr(_C, "OPS_ABI", None) != OPS_ABI:
    raise ImportError(
        f"vllm_metal._C is stale (ops ABI {getattr(_C, 'OPS_ABI', None)}, this package expects "
        f"{OPS_ABI}); {_REBUILD}"
    )
try:
    _C._abi_probe(mx.zeros((1,)))
except TypeError as exc:
    raise ImportError(
        "vllm_metal._C cannot exchange arrays with mlx.core (it must be built with "
        f"nanobind {_C.NANOBIND_VERSION} = MLX's and NB_DOMAIN mlx); {_REBUILD}"
    ) from exc

MLX_VERSION: str = _C.MLX_VERSION
HAS_METAL: bool = _C.HAS_METAL


def _on_gpu() -> bool:
    return HAS_METAL and mx.default_device() == mx.gpu


def _contiguous(*arrays: mx.array | None) -> list[mx.array | None]:
    # The Metal encoders bind buffers directly and cannot copy strided inputs themselves;
    # mx.contiguous is free for arrays that already are.
    return [None if a is None else mx.contiguous(a) for a in arrays]


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array]:
    if _on_gpu():
        key, value, slot_mapping = _contiguous(key, value, slot_mapping)
    return _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    if _on_gpu():
        query, block_tables, sinks = _contiguous(query, block_tables, sinks)
        # The GPU plan reads the per-sequence lengths on the host when it encodes the kernels.
        mx.eval(seq_lens, cu_seqlens_q)
    return _C.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale=float(scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        sinks=sinks,
    )


def num_threads() -> int:
    return _C.num_threads()


def set_num_threads(n: int) -> None:
    _C.set_num_threads(n)


def cpu_isa() -> str:
    return _C.cpu_isa()


def set_cpu_isa(name: str) -> bool:
    return _C.set_cpu_isa(name)
