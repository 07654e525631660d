"""Argument checks of the public ops: shapes and dtypes always, index values on request.

The shape/dtype checks read only metadata, so they never wait for the device; the value checks
(debug mode) read the index arrays on the host and are meant for tests and bring-up.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import mlx.core as mx
import numpy as np

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
# 512 (wide-head models): on Metal only the prefill-family kernels are built for it.
HEAD_SIZES = (64, 80, 96, 128, 256, 512)
BLOCK_SIZE_MULTIPLE = 8


def _fail(message: str) -> None:
    raise ValueError(message)


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _array(name: str, x: object) -> mx.array:
    if not isinstance(x, mx.array):
        _fail(f"{name} must be an mx.array, got {type(x).__name__}")
    return x


def _shape(name: str, x: mx.array, ndim: int, layout: str) -> tuple[int, ...]:
    if x.ndim != ndim:
        _fail(f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(x.shape)}")
    return tuple(x.shape)


def _float_dtype(name: str, x: mx.array) -> None:
    if x.dtype not in FLOAT_DTYPES:
        _fail(f"{name} must be float16, bfloat16 or float32, got {_dtype_name(x.dtype)}")


def _same_dtype(name: str, x: mx.array, ref_name: str, ref: mx.array) -> None:
    if x.dtype != ref.dtype:
        _fail(
            f"{name} dtype {_dtype_name(x.dtype)} differs from {ref_name} dtype "
            f"{_dtype_name(ref.dtype)}"
        )


def _index(name: str, x: mx.array, dtype: mx.Dtype, length: int, layout: str) -> None:
    _shape(name, x, 1, layout)
    if x.dtype != dtype:
        _fail(f"{name} must be {_dtype_name(dtype)}, got {_dtype_name(x.dtype)}")
    if x.shape[0] != length:
        _fail(f"{name} must have shape {layout} = ({length},), got shape {tuple(x.shape)}")


def _head_size(name: str, head_size: int) -> None:
    if head_size not in HEAD_SIZES:
        sizes = ", ".join(map(str, HEAD_SIZES))
        _fail(f"{name} head_size {head_size} is not supported (supported: {sizes})")


def _pool(name: str, pool: mx.array) -> tuple[int, int, int, int]:
    shape = _shape(name, pool, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    block_size = shape[1]
    if block_size <= 0 or block_size % BLOCK_SIZE_MULTIPLE:
        _fail(
            f"{name} block_size must be a positive multiple of {BLOCK_SIZE_MULTIPLE}, "
            f"got {block_size}"
        )
    if shape[0] <= 0 or shape[2] <= 0:
        _fail(f"{name} must have at least one block and one KV head, got shape {shape}")
    return shape  # type: ignore[return-value]


def _pools(key_cache: mx.array, value_cache: mx.array) -> tuple[int, int, int, int]:
    shape = _pool("key_cache", _array("key_cache", key_cache))
    _array("value_cache", value_cache)
    if tuple(value_cache.shape) != shape:
        _fail(f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape {shape}")
    _float_dtype("key_cache", key_cache)
    _same_dtype("value_cache", value_cache, "key_cache", key_cache)
    _head_size("key_cache", shape[3])
    return shape


def check_reshape_and_cache(
    key: object, value: object, key_cache: object, value_cache: object, slot_mapping: object
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    k_shape = _shape("key", _array("key", key), 3, "[num_tokens, num_kv_heads, head_size]")
    _array("value", value)
    if tuple(value.shape) != k_shape:
        _fail(f"value shape {tuple(value.shape)} differs from key shape {k_shape}")
    _, _, num_kv_heads, head_size = _pools(key_cache, value_cache)
    if k_shape[1:] != (num_kv_heads, head_size):
        _fail(
            f"key rows [num_kv_heads, head_size] = {list(k_shape[1:])} do not match key_cache "
            f"[num_kv_heads, head_size] = {[num_kv_heads, head_size]}"
        )
    _same_dtype("key", key, "key_cache", key_cache)
    _same_dtype("value", value, "key_cache", key_cache)
    _index(
        "slot_mapping", _array("slot_mapping", slot_mapping), mx.int64, k_shape[0], "[num_tokens]"
    )


def check_paged_attention(
    query: object,
    key_cache: object,
    value_cache: object,
    block_tables: object,
    seq_lens: object,
    cu_seqlens_q: object,
    scale: object,
    sliding_window: object,
    softcap: object,
    sinks: object,
) -> None:
    """Raises ValueError (naming the argument) unless the shapes, dtypes and options fit."""
    q_shape = _shape("query", _array("query", query), 3, "[num_tokens, num_heads, head_size]")
    _float_dtype("query", query)
    _head_size("query", q_shape[2])
    _, _, num_kv_heads, head_size = _pools(key_cache, value_cache)
    _same_dtype("key_cache", key_cache, "query", query)
    if head_size != q_shape[2]:
        _fail(f"key_cache head_size {head_size} differs from query head_size {q_shape[2]}")
    if q_shape[1] % num_kv_heads:
        _fail(
            f"query num_heads ({q_shape[1]}) must be a multiple of key_cache num_kv_heads "
            f"({num_kv_heads})"
        )
    bt_shape = _shape(
        "block_tables", _array("block_tables", block_tables), 2, "[num_seqs, max_blocks_per_seq]"
    )
    if block_tables.dtype != mx.int32:
        _fail(f"block_tables must be int32, got {_dtype_name(block_tables.dtype)}")
    num_seqs = bt_shape[0]
    _index("seq_lens", _array("seq_lens", seq_lens), mx.int32, num_seqs, "[num_seqs]")
    _index(
        "cu_seqlens_q",
        _array("cu_seqlens_q", cu_seqlens_q),
        mx.int32,
        num_seqs + 1,
        "[num_seqs + 1]",
    )

    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        _fail(f"scale must be a finite number, got {scale!r}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, Integral)
        or sliding_window <= 0
    ):
        _fail(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, Real)
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        _fail(f"softcap must be a positive number or None (None disables it), got {softcap!r}")
    if sinks is not None:
        _array("sinks", sinks)
        if tuple(sinks.shape) != (q_shape[1],):
            _fail(f"sinks must have shape [num_heads] = ({q_shape[1]},), got {tuple(sinks.shape)}")
        if sinks.dtype not in FLOAT_DTYPES:
            _fail(f"sinks must be float32 (or float16/bfloat16), got {_dtype_name(sinks.dtype)}")


def check_reshape_and_cache_values(key_cache: mx.array, slot_mapping: mx.array) -> None:
    """Raises ValueError when a slot is past the end of the pools (reads slot_mapping)."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = np.asarray(slot_mapping)
    bad = np.nonzero(slots >= num_slots)[0]
    if bad.size:
        t = int(bad[0])
        _fail(
            f"slot_mapping[{t}] = {int(slots[t])} is out of range for {num_slots} slots "
            f"(num_blocks * block_size)"
        )


def check_paged_attention_values(
    query: mx.array,
    key_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
) -> None:
    """Raises ValueError when the index arrays are inconsistent (reads them on the host)."""
    num_tokens = query.shape[0]
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    lens = np.asarray(seq_lens).astype(np.int64)
    tables = np.asarray(block_tables)
    if cu[0] != 0:
        _fail(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        s = int(np.nonzero(q_lens < 0)[0][0])
        _fail(f"cu_seqlens_q must be non-decreasing (cu_seqlens_q[{s + 1}] < cu_seqlens_q[{s}])")
    if cu[-1] > num_tokens:
        _fail(f"cu_seqlens_q[-1] = {int(cu[-1])} exceeds the {num_tokens} query tokens")
    short = np.nonzero(lens < q_lens)[0]
    if short.size:
        s = int(short[0])
        _fail(f"seq_lens[{s}] = {int(lens[s])} is shorter than its {int(q_lens[s])} query tokens")
    capacity = tables.shape[1] * block_size
    long = np.nonzero(lens > capacity)[0]
    if long.size:
        s = int(long[0])
        _fail(
            f"seq_lens[{s}] = {int(lens[s])} exceeds block_tables capacity "
            f"({tables.shape[1]} blocks x {block_size})"
        )
    for s, seq_len in enumerate(lens.tolist()):
        used = tables[s, : -(-seq_len // block_size)]
        bad = np.nonzero((used < 0) | (used >= num_blocks))[0]
        if bad.size:
            b = int(bad[0])
            _fail(
                f"block_tables[{s}, {b}] = {int(used[b])} is not a block id (0..{num_blocks - 1})"
            )
