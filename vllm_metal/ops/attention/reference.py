"""Pure-MLX reference of paged_attention (the contract: vllm_metal.ops.attention).

Written to be obviously correct rather than fast: the test oracle for the native op and the
fallback when the extension is not built. Reads the small index arrays on the host.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from vllm_metal.ops.fp8 import KVQuant


def gather_sequence_rows(pool: mx.array, block_table: mx.array, seq_len: int) -> mx.array:
    """The first ``seq_len`` token rows of one sequence from a paged pool ``[num_blocks,
    block_size, ...]``: ``[seq_len, ...]``."""
    block_size = pool.shape[1]
    num_used = math.ceil(seq_len / block_size)
    rows = pool[block_table[:num_used]]
    return rows.reshape(num_used * block_size, *pool.shape[2:])[:seq_len]


def gather_sequence_kv(
    key_cache: mx.array, value_cache: mx.array, block_table: mx.array, seq_len: int
) -> tuple[mx.array, mx.array]:
    """The first ``seq_len`` keys and values of one sequence, ``[seq_len, H_kv, D]`` each."""
    return (
        gather_sequence_rows(key_cache, block_table, seq_len),
        gather_sequence_rows(value_cache, block_table, seq_len),
    )


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
    key_ends: np.ndarray | None = None,
    quant: KVQuant | None = None,
) -> mx.array:
    """vllm_metal.ops.paged_attention on validated arguments, one sequence at a time in float32:
    gather the sequence's keys, mask by position, softmax (with the sink logits), weight values.
    ``quant``: the pools hold fp8 bytes, read as ``quant`` says (in the query's dtype)."""
    num_tokens, num_heads, head_size = query.shape
    cu = np.asarray(cu_seqlens_q).astype(np.int64).tolist()
    lens = np.asarray(seq_lens).astype(np.int64).tolist()
    options = {
        "scale": scale,
        "sliding_window": sliding_window,
        "softcap": softcap,
        "sinks": sinks,
        "quant": quant,
    }

    out = mx.zeros((num_tokens, num_heads, head_size), dtype=query.dtype)
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if end <= start:
            continue
        positions = np.arange(seq_len - (end - start), seq_len)
        ends = None if key_ends is None else key_ends[start:end]
        out[start:end] = attend_rows(
            query[start:end],
            key_cache,
            value_cache,
            block_tables[s],
            seq_len,
            positions,
            ends,
            **options,
        )
    return out


def attend_rows(
    rows: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_table: mx.array,
    seq_len: int,
    positions: np.ndarray,
    key_ends: np.ndarray | None,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: mx.array | None,
    quant: KVQuant | None = None,
) -> mx.array:
    """Attention of some query rows (`[n, Hq, D]`) of one sequence, at `positions` (`[n]`): row
    `i` sees key positions `max(0, p - sliding_window + 1) .. max(p, key_ends[i] - 1)` of the
    sequence's first `seq_len` keys (`key_ends` None: causal, `.. p`)."""
    n, num_heads, head_size = rows.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    keys, values = gather_sequence_kv(key_cache, value_cache, block_table, seq_len)
    if quant is not None:
        keys, values = quant.keys(keys, rows.dtype), quant.values(values, rows.dtype)
    # [H_kv, group, n, D] queries against [H_kv, 1, D, seq_len] keys.
    q = rows.astype(mx.float32).reshape(n, num_kv_heads, group, head_size).transpose(1, 2, 0, 3)
    k = keys.astype(mx.float32).transpose(1, 2, 0)[:, None]
    v = values.astype(mx.float32).transpose(1, 0, 2)[:, None]
    logits = (q @ k) * scale
    if softcap is not None:
        logits = softcap * mx.tanh(logits / softcap)

    query_pos = mx.array(positions.astype(np.int32))[:, None]
    last = query_pos
    if key_ends is not None:
        last = mx.maximum(query_pos, mx.array(key_ends.astype(np.int32))[:, None] - 1)
    key_pos = mx.arange(seq_len)[None, :]
    visible = key_pos <= last
    if sliding_window is not None:
        visible = visible & (key_pos > query_pos - sliding_window)
    logits = mx.where(visible, logits, -mx.inf)

    if sinks is not None:
        sink = sinks.astype(mx.float32).reshape(num_kv_heads, group, 1, 1)
        sink = mx.broadcast_to(sink, (num_kv_heads, group, n, 1))
        probs = mx.softmax(mx.concatenate([sink, logits], axis=-1), axis=-1)[..., 1:]
    else:
        probs = mx.softmax(logits, axis=-1)
    return (probs @ v).transpose(2, 0, 1, 3).reshape(n, num_heads, head_size).astype(rows.dtype)
