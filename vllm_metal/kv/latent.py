"""What a multi-head latent attention (MLA) layer sees as its cache during a step.

An MLA layer (DeepSeek-V2/V3) compresses each token's keys and values into one row: a latent
vector (`kv_lora_rank` wide) and a rotary key part shared by every head. The cache holds only
that row, `[num_blocks, block_size, kv_lora_rank + rope_dim]` per layer (vLLM's
`MLAAttentionSpec`, one KV head, no separate values: `KVPool(latent=True)`). Attention runs in the
absorbed form: each head's query is carried into the latent space beforehand (the family adapter
multiplies its non-rotary part by the head's key up-projection), so scores are dot products with
the cached row and the head's output is a mix of the rows' latent parts, which the adapter then
maps back up with the head's value up-projection. Decode therefore reads each cached row once for
all heads (`ops.mla_attention`).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal import ops
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata
from vllm_metal.kv.pool import KVPool


class LatentLayerCache:
    def __init__(self, pool: KVPool, region: int, meta: StepMetadata, tables: GroupTables):
        if not pool.latent:
            raise ValueError("a latent-attention layer needs a latent KVPool (latent=True)")
        self.pool = pool
        self.region = region
        self.meta = meta
        self.tables = tables

    @property
    def offset(self) -> mx.array:
        # Each packed row is one token; rotary embeddings take its position.
        return self.meta.positions

    def write(self, rows: mx.array) -> None:
        """Store the step's latent rows (`[T, D]`: latent then rotary key) at their slots."""
        self.pool.keys[self.region] = ops.mla_reshape_and_cache(
            rows.astype(self.pool.dtype),
            self.pool.keys[self.region],
            self.tables.slot_mapping,
            padded=self.meta.query_rows is None,
        )

    def attend(self, queries: mx.array, scale: float, value_dim: int) -> mx.array:
        """Absorbed queries `[T, H, D]` over every cached row up to each token's position:
        `[T, H, value_dim]`, the mix of the rows' first `value_dim` entries, in the query dtype."""
        out = ops.mla_attention(
            queries.astype(self.pool.dtype),
            self.pool.keys[self.region],
            self.tables.block_tables,
            self.meta.seq_lens,
            self.meta.cu_seqlens_q,
            scale=float(scale),
            value_dim=value_dim,
            max_query_len=self.meta.query_rows,
        )
        return out.astype(queries.dtype)
