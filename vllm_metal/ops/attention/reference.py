"""Pure-MLX reference of paged_attention (the contract: vllm_metal.ops.attention).

Written to be obviously correct rather than fast: the test oracle for the native op and the
fallback when the extension is not built. Reads the small index arrays on the host.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np


def gather_sequence_kv(
    key_cache: mx.array, value_cache: mx.array, block_table: mx.array, seq_len: int
) -> tuple[mx.array, mx.array]:
    """The first ``seq_len`` keys and values of one sequence, ``[seq_len, H_kv, D]`` each."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_used = math.ceil(seq_len / block_size)
    blocks = block_table[:num_used]
    keys = key_cache[blocks].reshape(num_used * block_size, num_kv_heads, head_size)[:seq_len]
    values = value_cache[blocks].reshape(num_used * block_size, num_kv_heads, head_size)[:seq_len]
    return keys, values


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
    """vllm_metal.ops.paged_attention on validated arguments, one sequence at a time in float32:
    gather the sequence's keys, mask by position, softmax (with the sink logits), weight values."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = np.asarray(cu_seqlens_q).astype(np.int64).tolist()
    lens = np.asarray(seq_lens).astype(np.int64).tolist()

    out = mx.zeros((num_tokens, num_heads, head_size), dtype=query.dtype)
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        q_len = end - start
        if q_len <= 0:
            continue
        keys, values = gather_sequence_kv(key_cache, value_cache, block_tables[s], seq_len)
        # [H_kv, group, q_len, D] queries against [H_kv, 1, D, seq_len] keys.
        q = query[start:end].astype(mx.float32).reshape(q_len, num_kv_heads, group, head_size)
        q = q.transpose(1, 2, 0, 3)
        k = keys.astype(mx.float32).transpose(1, 2, 0)[:, None]
        v = values.astype(mx.float32).transpose(1, 0, 2)[:, None]
        logits = (q @ k) * scale
        if softcap is not None:
            logits = softcap * mx.tanh(logits / softcap)

        query_pos = (seq_len - q_len + mx.arange(q_len))[:, None]
        key_pos = mx.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible = visible & (key_pos > query_pos - sliding_window)
        logits = mx.where(visible, logits, -mx.inf)

        if sinks is not None:
            sink = sinks.astype(mx.float32).reshape(num_kv_heads, group, 1, 1)
            sink = mx.broadcast_to(sink, (num_kv_heads, group, q_len, 1))
            probs = mx.softmax(mx.concatenate([sink, logits], axis=-1), axis=-1)[..., 1:]
        else:
            probs = mx.softmax(logits, axis=-1)
        o = (probs @ v).transpose(2, 0, 1, 3).reshape(q_len, num_heads, head_size)
        out[start:end] = o.astype(query.dtype)
    return out
