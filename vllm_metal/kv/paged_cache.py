"""What one attention layer sees as its cache during a step: a view of the paged pools.

mlx-lm's attention calls `cache.update_and_fetch(keys, values)` and then attends; here the first
writes the step's K/V into the layer's paged region (`ops.reshape_and_cache`) and `attend` runs
`ops.paged_attention` over it. Where this departs from mlx-lm's cache contract:
- `update_and_fetch` returns the step's own keys/values, not the whole history (the history
  stays paged; only `attend` reads it), so attention must go through `attend`;
- `offset` is a per-row position array (every packed row is one token of some sequence), not
  one integer for the batch;
- there is no `state`, trimming or rotation: vLLM's KV manager owns the blocks.
The model may compute in a wider dtype than the cache stores; K/V are cast on write and queries
on read, so the cache keeps the dtype vLLM sized it for. An fp8 cache (`kv.quant`) stores bytes:
rows are cast to the pool's `row_dtype`, and the ops quantize them with the layer's scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal import ops
from vllm_metal.kv.pool import KVPool
from vllm_metal.ops.fp8 import KVQuant


@dataclass
class GroupTables:
    """One KV-cache group's view of the step."""

    block_tables: mx.array  # [S, max_blocks] int32
    slot_mapping: mx.array  # [T] int64, KV slot each token writes (negative = skip)


@dataclass
class StepMetadata:
    """Varlen batch of one step (the layout contract of docs/architecture.md), on the device."""

    positions: mx.array  # [T] int32, position of each packed token in its sequence
    seq_lens: mx.array  # [S] int32, context length after this step
    cu_seqlens_q: mx.array  # [S+1] int32
    groups: list[GroupTables]
    # [T] host ints: how far each token's attention reaches past its own position (the tokens
    # of one image attend to each other in prefix-LM models); None: causal everywhere.
    key_ends: np.ndarray | None = None
    # A step traced by mx.compile: every sequence has `query_rows` tokens (1: decode; 1 + k: a
    # step verifying k drafts), every slot in range; the ops then read nothing on the host
    # (their `max_query_len=query_rows`, `padded=False`). None: an eager step.
    query_rows: int | None = None

    @property
    def decode(self) -> bool:
        """A traced step of one token per sequence."""
        return self.query_rows == 1


class PagedLayerCache:
    """`page_shape`: (block size, KV heads, head size) the layer reads its region as, where that
    differs from the region's own shape (`KVPool.page_view`). `writes=False`: the layer attends
    over another layer's K/V (`LayerKind.kv_source`) and writes none; its `update_and_fetch`
    stores nothing. `bidirectional=False`: the layer stays causal where the step's media are
    attended both ways (`StepMetadata.key_ends`). `quant`: the layer's fp8 format and scales
    (`KVPool.layer_quant`), None for an unquantized pool."""

    def __init__(
        self,
        pool: KVPool,
        region: int,
        meta: StepMetadata,
        tables: GroupTables,
        sliding_window: int | None,
        page_shape: tuple[int, int, int] | None = None,
        writes: bool = True,
        bidirectional: bool = True,
        quant: KVQuant | None = None,
    ):
        self.pool = pool
        self.region = region
        self.meta = meta
        self.tables = tables
        self.sliding_window = sliding_window
        self.page_shape = page_shape
        self.writes = writes
        # Whether the step's key ends (media attended both ways) apply to this layer.
        self.key_ends = meta.key_ends if bidirectional else None
        self.storage: dict = {} if quant is None else quant.options()

    def _pages(self, arrays: list[mx.array]) -> mx.array:
        array = arrays[self.region]
        if self.page_shape is None:
            return array
        return KVPool.page_view(array, *self.page_shape, self.pool.dtype)

    @property
    def offset(self) -> mx.array:
        # mlx-lm's RoPE takes a per-batch-row offset; each packed row is one token.
        return self.meta.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if not self.writes:
            return keys, values
        t, h, _, d = keys.shape  # [T, H_kv, 1, D]
        dtype = self.pool.row_dtype
        kc, vc = ops.reshape_and_cache(
            keys.reshape(t, h, d).astype(dtype),
            values.reshape(t, h, d).astype(dtype),
            self._pages(self.pool.keys),
            self._pages(self.pool.values),
            self.tables.slot_mapping,
            padded=self.meta.query_rows is None,
            **self.storage,
        )
        pool = self.pool
        storage = self.storage.get("kv_cache_dtype", "auto")
        in_place = functools.partial(ops.cache.writes_in_place, d, storage)
        pool.keys[self.region] = KVPool.written(pool.keys[self.region], kc, in_place)
        pool.values[self.region] = KVPool.written(pool.values[self.region], vc, in_place)
        return keys, values

    def attend(
        self,
        queries: mx.array,
        scale: float,
        sinks: mx.array | None,
        softcap: float | None = None,
    ) -> mx.array:
        t, h, _, d = queries.shape  # [T, H_q, 1, D]
        out = ops.paged_attention(
            queries.reshape(t, h, d).astype(self.pool.row_dtype),
            self._pages(self.pool.keys),
            self._pages(self.pool.values),
            self.tables.block_tables,
            self.meta.seq_lens,
            self.meta.cu_seqlens_q,
            scale=float(scale),
            sliding_window=self.sliding_window,
            softcap=softcap,
            sinks=None if sinks is None else sinks.astype(mx.float32),
            key_ends=self.key_ends,
            max_query_len=self.meta.query_rows,
            **self.storage,
        )
        return out.reshape(t, h, 1, d).astype(queries.dtype)
