"""Pure-MLX references of mla_attention and mla_reshape_and_cache (the contract:
vllm_metal.ops.mla).

Written to be obviously correct rather than fast: the test oracles for the native ops and the
fallback when the extension is not built. Read the small index arrays on the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.ops.attention.reference import gather_sequence_rows
from vllm_metal.ops.cache.reference import write_rows


def mla_attention(
    query: mx.array,
    latent_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    value_dim: int,
) -> mx.array:
    """vllm_metal.ops.mla_attention on validated arguments, one sequence at a time in float32:
    gather the sequence's latent rows, logits against all their columns, causal mask by position,
    softmax, weight the rows' first ``value_dim`` columns."""
    num_tokens, num_heads, _ = query.shape
    cu = np.asarray(cu_seqlens_q).astype(np.int64).tolist()
    lens = np.asarray(seq_lens).astype(np.int64).tolist()
    out = mx.zeros((num_tokens, num_heads, value_dim), dtype=query.dtype)
    for s, seq_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if end <= start:
            continue
        rows = gather_sequence_rows(latent_cache, block_tables[s], seq_len).astype(mx.float32)
        q = query[start:end].astype(mx.float32)  # [n, H, D]
        logits = (q @ rows.T) * scale  # [n, H, seq_len]
        positions = mx.arange(seq_len - (end - start), seq_len)[:, None, None]
        visible = mx.arange(seq_len)[None, None, :] <= positions
        probs = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1)
        out[start:end] = (probs @ rows[:, :value_dim]).astype(query.dtype)
    return out


def mla_reshape_and_cache(
    latent: mx.array, latent_cache: mx.array, slot_mapping: mx.array
) -> mx.array:
    """vllm_metal.ops.mla_reshape_and_cache on validated arguments, as a scatter into the
    flattened cache. Returns a new cache array; the input is left unchanged."""
    return write_rows(latent_cache, latent, slot_mapping)
