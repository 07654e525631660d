"""The pure-MLX multi-head latent attention of a step whose sequences all have the same number of
query rows (a decode step, or one verifying drafts: `max_query_len`, the contract in
vllm_metal.ops.mla), as one graph for the whole batch.

Each sequence gathers every block of its table row, so nothing is read on the host while the
graph is built and the call can be traced by `mx.compile` (the GPU proxy's compiled decode steps
of MLA models). Rows past a sequence's length are zeroed before they are read, so what a block
table's padding names (any block) stays out.
"""

from __future__ import annotations

import mlx.core as mx


def mla_attention(
    query: mx.array,
    latent_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    *,
    scale: float,
    value_dim: int,
    rows: int,
) -> mx.array:
    """`ops.mla_attention` on validated arguments where every sequence has `rows` query rows
    (`query` is `[rows * S, H, D]`, `cu_seqlens_q` `0, rows, 2 rows, ..`)."""
    num_seqs, num_blocks = block_tables.shape
    _, num_heads, dim = query.shape
    length = num_blocks * latent_cache.shape[1]
    keys = latent_cache[block_tables].reshape(num_seqs, length, dim).astype(mx.float32)
    key_pos = mx.arange(length)
    keys = mx.where((key_pos[None, :] < seq_lens[:, None])[..., None], keys, 0.0)
    q = query.astype(mx.float32).reshape(num_seqs, rows * num_heads, dim)
    logits = (q @ keys.transpose(0, 2, 1)) * scale  # [S, rows * H, L]
    # Query row i of sequence s sits at position seq_lens[s] - rows + i and sees keys up to it.
    positions = seq_lens[:, None] - rows + mx.arange(rows)[None, :]  # [S, rows]
    visible = key_pos[None, None, :] <= positions[:, :, None]  # [S, rows, L]
    visible = mx.repeat(visible, num_heads, axis=1)  # [S, rows * H, L], row-major as q
    probs = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1)
    out = probs @ keys[:, :, :value_dim]  # [S, rows * H, value_dim]
    return out.reshape(num_seqs * rows, num_heads, value_dim).astype(query.dtype)
