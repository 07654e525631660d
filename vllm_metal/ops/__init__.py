"""Validated entry points of the attention ops: paged KV-cache writes and paged attention.

Calls run the compiled extension (vllm_metal._C) when it is built for this MLX, otherwise, or with
VLLM_METAL_USE_REFERENCE_OPS=1, the pure-MLX reference in vllm_metal.ops.reference.
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.ops import reference
from vllm_metal.ops._checks import (
    BLOCK_SIZE_MULTIPLE,
    FLOAT_DTYPES,
    HEAD_SIZES,
    check_paged_attention,
    check_paged_attention_values,
    check_reshape_and_cache,
    check_reshape_and_cache_values,
)

__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "FLOAT_DTYPES",
    "HEAD_SIZES",
    "backend",
    "native_available",
    "native_unavailable_reason",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "set_value_checks",
]

logger = init_logger(__name__)

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


def native_available() -> bool:
    """True when the compiled extension is importable and matches the installed MLX."""
    return _native_ops is not None


def native_unavailable_reason() -> str | None:
    """Why the extension could not be used (None when it can)."""
    return _NATIVE_ERROR


def backend() -> str:
    """``"native"`` or ``"reference"``: the implementation the next call will use."""
    if _native_ops is None or envs.VLLM_METAL_USE_REFERENCE_OPS:
        return "reference"
    return "native"


def set_value_checks(enabled: bool) -> None:
    """Also validate index values (slot range, block ids, sequence lengths) on every call.

    This reads the index arrays on the host, so it synchronises; meant for tests and debugging.
    """
    global _value_checks
    _value_checks = bool(enabled)


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array]:
    """Writes key/value rows ``[T, H_kv, D]`` into the paged pools at ``slot_mapping`` (int64).

    Pools are ``[num_blocks, block_size, H_kv, D]``; slot = block_id * block_size + offset; a
    negative slot is padding and skipped. Returns the updated pools: rebind your references to
    them. The native op writes in place, so the returned arrays share the inputs' memory.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if _value_checks:
        check_reshape_and_cache_values(key_cache, slot_mapping)
    if _native_ops is not None and not envs.VLLM_METAL_USE_REFERENCE_OPS:
        return _native_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


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
    """Varlen causal attention of packed queries ``[T, Hq, D]`` over paged K/V pools.

    ``cu_seqlens_q [S+1]``, ``seq_lens [S]`` (context length after this step) and
    ``block_tables [S, max_blocks]`` are int32. Query row ``i`` of sequence ``s`` sits at position
    ``seq_lens[s] - q_len[s] + i`` and attends to keys at positions up to its own (the last
    ``sliding_window`` of them with a window). ``softcap`` maps a scaled logit ``x`` to
    ``softcap * tanh(x / softcap)``; ``sinks [Hq]`` adds one zero-value logit per query head.
    """
    check_paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale,
        sliding_window,
        softcap,
        sinks,
    )
    if _value_checks:
        check_paged_attention_values(query, key_cache, block_tables, seq_lens, cu_seqlens_q)
    impl = (
        _native_ops
        if _native_ops is not None and not envs.VLLM_METAL_USE_REFERENCE_OPS
        else reference
    )
    return impl.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
    )
