"""TurboQuant KV caches (``--kv-cache-dtype turboquant_*``): the paged cache write and the paged
attention over pools holding vLLM 0.32's TurboQuant slot bytes (`codec`).

Where the compiled extension serves the call (`native`: a C++ CPU body and Metal kernels), the
write quantizes there, and attention over rows that read every key from the cache (decode steps,
short continuation and verification chunks) reads the pools at their stored width in the kernel.
Otherwise (``VLLM_METAL_USE_REFERENCE_OPS=1``, no extension, a head size without Metal kernels on
the GPU, or a step with a prefill chunk that attends over its own unquantized rows) both run on
MLX ops, one graph per layer: the write quantizes the step's rows and scatters their bytes; the
attention gathers the pages the block tables name, dequantizes them to float32 and runs
`ops.paged_attention` over them (windows, soft-capping, sinks and GQA as that op defines them).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _validate as v
from vllm_metal.ops.attention import paged_attention as float_paged_attention
from vllm_metal.ops.cache import batched
from vllm_metal.ops.turboquant import native as _native
from vllm_metal.ops.turboquant.codec import (
    TurboQuantFormat,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
    scoring_space,
)

# vLLM's TurboQuant backend runs a continuation chunk of at most this many query rows through
# its decode kernel (every key read from the cache); longer chunks and first chunks attend over
# their own keys and values unquantized (`_CONTINUATION_DECODE_THRESHOLD`).
CONTINUATION_DECODE_MAX = 128

__all__ = [
    "CONTINUATION_DECODE_MAX",
    "TurboQuantFormat",
    "paged_attention",
    "reshape_and_cache",
]


def _check_pools(key_cache: object, value_cache: object, fmt: TurboQuantFormat) -> None:
    for name, pool, width in (
        ("key_cache", key_cache, fmt.key_bytes),
        ("value_cache", value_cache, fmt.value_bytes),
    ):
        shape = v.shape(name, pool, 4, "[num_blocks, block_size, num_kv_heads, slot bytes]")
        if pool.dtype != mx.uint8:
            v.fail(f"{name} of {fmt.name} must be uint8, got {v.dtype_name(pool.dtype)}")
        if shape[3] != width:
            v.fail(f"{name} of {fmt.name} at head size {fmt.head_dim} holds {width} bytes per "
                   f"slot, got {shape[3]}")  # fmt: skip
    if tuple(key_cache.shape[:3]) != tuple(value_cache.shape[:3]):
        v.fail(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} "
               "differ in blocks, block size or heads")  # fmt: skip


def _check_rows(name: str, rows: object, fmt: TurboQuantFormat) -> None:
    shape = v.shape(name, rows, 3, "[num_tokens, num_heads, head_size]")
    v.float_dtype(name, rows)
    if shape[2] != fmt.head_dim:
        v.fail(f"{name} head_size {shape[2]} differs from the format's {fmt.head_dim}")


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
    *,
    fmt: TurboQuantFormat,
    padded: bool = True,
) -> tuple[mx.array, mx.array]:
    """Quantizes key/value rows ``[T, Hkv, D]`` (any float dtype) to `fmt`'s slot bytes and writes
    them at ``slot_mapping`` (int64; negative: padding, skipped) into ``key_cache`` ``[num_blocks,
    block_size, Hkv, fmt.key_bytes]`` and ``value_cache`` ``[..., fmt.value_bytes]`` (uint8).
    Returns the updated pools; ``padded=False``: every slot is in range (reads nothing on the
    host)."""
    _check_rows("key", key, fmt)
    _check_rows("value", value, fmt)
    _check_pools(key_cache, value_cache, fmt)
    if key.shape != value.shape or key.shape[1] != key_cache.shape[2]:
        v.fail(f"key {tuple(key.shape)}, value {tuple(value.shape)} and the pools' "
               f"{key_cache.shape[2]} KV heads disagree")  # fmt: skip
    native = _native.module(fmt.head_dim)
    if native is not None:
        return _native.write(native, key, value, key_cache, value_cache, slot_mapping, fmt)
    return batched.reshape_and_cache(
        quantize_keys(key, fmt),
        quantize_values(value, fmt),
        key_cache,
        value_cache,
        slot_mapping,
        padded,
    )


def writes_in_place(fmt: TurboQuantFormat) -> bool:
    """Whether `reshape_and_cache` in `fmt` runs the native op, which writes into the pools'
    memory (a view of a region included); the MLX one returns new arrays."""
    return _native.module(fmt.head_dim) is not None


def paged_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    fmt: TurboQuantFormat,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    key: mx.array | None = None,
    value: mx.array | None = None,
    max_query_len: int | None = None,
) -> mx.array:
    """`ops.paged_attention` (the same varlen contract) over TurboQuant pools written by
    `reshape_and_cache`: a stored key reads as `codec.dequantize_keys` (scored against the query
    rotated into its space), a value as `codec.dequantize_values`, in float32; the result has the
    query's dtype.

    ``key``/``value`` (optional, ``[T, Hkv, D]``: the step's rows as the model computed them)
    give vLLM's prefill rule: the rows of a sequence with more than one query row that starts its
    context in this step, or has more than `CONTINUATION_DECODE_MAX` query rows, attend over this
    step's keys and values unquantized (earlier positions as stored); every other row (decode,
    short continuations, speculative verification) reads all its keys from the cache. Without
    them every key is read from the cache. ``max_query_len=1``: a decode step (nothing read on the
    host; `key`/`value` unused)."""
    _check_rows("query", query, fmt)
    _check_pools(key_cache, value_cache, fmt)
    native = _native.module(fmt.head_dim)
    fresh = key is not None and value is not None and max_query_len != 1
    if native is not None and (
        not fresh or _native.reads_cache_only(seq_lens, cu_seqlens_q, CONTINUATION_DECODE_MAX)
    ):
        out = _native.attention(
            native,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            fmt=fmt,
            scale=scale,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
            decode=max_query_len == 1,
        )
        return out.astype(query.dtype)
    num_seqs, max_blocks = block_tables.shape
    # The pages of every table entry, each sequence its own copy: [S * max_blocks, ...].
    ids = mx.maximum(block_tables.reshape(-1), 0)
    keys = dequantize_keys(key_cache[ids], fmt)
    values = dequantize_values(value_cache[ids], fmt)
    if fresh:
        keys, values = _overlay_fresh(
            keys, values, scoring_space(key, fmt), value, seq_lens, cu_seqlens_q, max_blocks
        )
    tables = mx.arange(num_seqs * max_blocks, dtype=mx.int32).reshape(num_seqs, max_blocks)
    out = float_paged_attention(
        scoring_space(query, fmt),
        keys,
        values,
        tables,
        seq_lens,
        cu_seqlens_q,
        scale=scale,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=sinks,
        max_query_len=max_query_len,
    )
    return out.astype(query.dtype)


def _overlay_fresh(
    keys: mx.array,
    values: mx.array,
    fresh_keys: mx.array,
    fresh_values: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    max_blocks: int,
) -> tuple[mx.array, mx.array]:
    """The gathered pages with the step's own rows written unquantized where vLLM's prefill
    attends over them so (see `paged_attention`)."""
    pages, block_size = keys.shape[0], keys.shape[1]
    cu = cu_seqlens_q.astype(mx.int32)
    # Rows past the last sequence (padding) belong to none: drop them (a host read of an array
    # made from host data, as the float op's own checks do outside decode steps).
    num_tokens = int(cu[-1].item())
    fresh_keys, fresh_values = fresh_keys[:num_tokens], fresh_values[:num_tokens]
    q_len = cu[1:] - cu[:-1]
    computed = seq_lens.astype(mx.int32) - q_len
    fresh_seq = (q_len > 1) & ((computed == 0) | (q_len > CONTINUATION_DECODE_MAX))
    token = mx.arange(num_tokens, dtype=mx.int32)
    seq = (token[:, None] >= cu[None, 1:]).astype(mx.int32).sum(-1)
    # Each token's own (sequence, position) row: rows that stay quantized write back what the
    # page holds, so no two tokens write one row.
    row = seq * (max_blocks * block_size) + computed[seq] + token - cu[seq]
    mask = fresh_seq[seq][:, None, None]
    out = []
    for pages_of, rows in ((keys, fresh_keys), (values, fresh_values)):
        flat = pages_of.reshape(pages * block_size, *pages_of.shape[2:])
        flat[row] = mx.where(mask, rows.astype(mx.float32), flat[row])
        out.append(flat.reshape(pages_of.shape))
    return out[0], out[1]
