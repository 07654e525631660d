"""Loader of the compiled extension ``vllm_metal._C``, checked against the MLX installed here,
and its unvalidated ops (vllm_metal.ops validates, then calls these) and runtime knobs.

Importing this module raises ImportError, with the reason and the fix, when the extension is not
built, was built for another MLX or ops ABI, or cannot exchange arrays with ``mlx.core``.
"""

from __future__ import annotations

import functools
import re

import mlx.core as mx  # loads libmlx before the extension that links against it

from vllm_metal._logging import init_logger
from vllm_metal.ops import _gpu, _header
from vllm_metal.ops.fp8 import KVQuant
from vllm_metal.ops.per_token_head import PerTokenHeadQuant

logger = init_logger("vllm_metal.ops")

# The ABI of this package's sources; a _C built from other sources reports another.
OPS_ABI = _header.header_constants()["OPS_ABI"]

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


def _metal_facts() -> dict | None:
    """MLX's name and generation of the GPU, and whether the NAX kernels run on it (GPU builds)."""
    return _C.metal_device_facts() if HAS_METAL else None


@functools.cache
def _configure_gpu() -> None:
    """Hands the GPU's core count to the planner and logs what the kernel choice will use."""
    # Metal has no API for the core count; the planner's split-KV choice depends on it.
    cores = _gpu.read_gpu_core_count()
    if cores is None:
        logger.warning(
            "could not read the GPU core count from the IORegistry; split-KV decode is planned "
            "for %d cores",
            _C.gpu_cores(),
        )
    else:
        _C.set_gpu_cores(cores)
    facts = _metal_facts()
    if facts is None:
        return
    logger.info(
        "Metal GPU %s (generation %d), %d cores; NAX prefill kernels: %s",
        facts["architecture"],
        facts["architecture_gen"],
        _C.gpu_cores(),
        "yes" if facts["nax"] else "no (they need an M5-class GPU, macOS 26.2 and a Metal 4 build)",
    )


def on_gpu() -> bool:
    """True when the next call runs the Metal kernels (a GPU build, MLX's default device the GPU)."""
    if not (HAS_METAL and mx.default_device() == mx.gpu):
        return False
    _configure_gpu()
    return True


def uncommitted_bytes(shape: list[int]) -> mx.array:
    """A uint8 array of `shape` whose memory is allocated but not written: its pages are committed
    as they are first written. Contents undefined."""
    return _C.uncommitted_bytes(shape)


def _contiguous(*arrays: mx.array | None) -> list[mx.array | None]:
    # The Metal encoders bind buffers directly and cannot copy strided inputs themselves;
    # mx.contiguous is free for arrays that already are.
    return [None if a is None else mx.contiguous(a) for a in arrays]


def reshape_and_cache(
    *arrays: mx.array, quant: KVQuant | PerTokenHeadQuant | None = None
) -> tuple[mx.array, mx.array]:
    """arrays: key, value, key_cache, value_cache, slot_mapping. ``quant``: fp8 or per-token-head
    pools (int4: rows already rotated), which the C++ CPU body and the Metal kernel write
    quantized."""
    key, value, key_cache, value_cache, slot_mapping = arrays
    if on_gpu():
        key, value, slot_mapping = _contiguous(key, value, slot_mapping)
    return _C.reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        **({} if quant is None else quant.options()),
    )


def paged_attention(
    *arrays: mx.array,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    quant: KVQuant | PerTokenHeadQuant | None = None,
    uniform: int | None = None,
) -> mx.array:
    """arrays: query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q. ``quant``: fp8
    or per-token-head pools (int4: the query already rotated, the scale divided by the rotation
    block), which the C++ CPU body and every Metal kernel family read. ``uniform``: every sequence
    has that many query rows, lengths made from host data (the call may be traced by
    mx.compile)."""
    query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q = arrays
    if on_gpu():
        query, block_tables, sinks = _contiguous(query, block_tables, sinks)
        if uniform is None:
            # The GPU plan reads the per-sequence lengths on the host when it encodes the
            # kernels; a traced step's lengths already hold their values.
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
        **({} if quant is None else quant.options()),
    )


def gated_delta_rule(*arrays: mx.array) -> tuple[mx.array, mx.array]:
    """arrays: q, k, v, g, beta, state, cu_seqlens."""
    if on_gpu():
        if arrays[0].shape[2] > _C.CONSTANTS["GATED_DELTA_MAX_KEY_DIM"]:
            # The Metal kernel holds a state row in registers; wider keys run the reference.
            from vllm_metal.ops.gated_delta import reference

            return reference.gated_delta_rule(*arrays)
        arrays = _contiguous(*arrays)
    return _C.gated_delta_rule(*arrays)


def causal_conv1d(
    x: mx.array,
    weight: mx.array,
    conv_state: mx.array,
    cu_seqlens: mx.array,
    bias: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    arrays = [x, weight, conv_state, cu_seqlens, bias]
    if on_gpu():
        arrays = _contiguous(*arrays)
    return _C.causal_conv1d(*arrays)


def mamba2_scan(*arrays: mx.array) -> tuple[mx.array, mx.array]:
    """arrays: x, dt, A, B, C, D, state, cu_seqlens."""
    if on_gpu():
        if arrays[3].shape[2] > _C.CONSTANTS["MAMBA2_MAX_STATE_DIM"]:
            # The Metal kernel holds a state row in registers; larger states run the reference.
            from vllm_metal.ops.mamba2 import reference

            return reference.mamba2_scan(*arrays)
        arrays = _contiguous(*arrays)
    return _C.mamba2_scan(*arrays)


def mla_attention(*arrays: mx.array, scale: float, value_dim: int) -> mx.array:
    """arrays: query, latent_cache, block_tables, seq_lens, cu_seqlens_q."""
    query, latent_cache, *index = arrays
    if on_gpu():
        # The kernel reads the cache through its block and slot strides (a layer slice of a larger
        # allocation is used in place).
        query, *index = _contiguous(query, *index)
    return _C.mla_attention(
        query, latent_cache, *index, scale=float(scale), value_dim=int(value_dim)
    )


def mla_reshape_and_cache(
    latent: mx.array, latent_cache: mx.array, slot_mapping: mx.array
) -> mx.array:
    if on_gpu():
        latent, slot_mapping = _contiguous(latent, slot_mapping)
    return _C.mla_reshape_and_cache(latent, latent_cache, slot_mapping)


def rotary_embedding(
    positions: mx.array, query: mx.array, key: mx.array, cos_sin_cache: mx.array, is_neox: bool
) -> tuple[mx.array, mx.array]:
    if on_gpu():
        # The kernel reads query and key through their strides (views of a fused QKV projection
        # are used in place).
        positions, cos_sin_cache = _contiguous(positions, cos_sin_cache)
    return _C.rotary_embedding(positions, query, key, cos_sin_cache, bool(is_neox))


def gpu_cores() -> int:
    return _C.gpu_cores()


def num_threads() -> int:
    return _C.num_threads()


def set_num_threads(n: int) -> None:
    _C.set_num_threads(n)


def cpu_isa() -> str:
    return _C.cpu_isa()


def set_cpu_isa(name: str) -> bool:
    return _C.set_cpu_isa(name)
