"""Builders of random paged-attention batches for the ops tests, with poisoned unused memory.

Pools are filled with random data where a sequence's keys live and with NaN everywhere else, so a
kernel that reads an unused slot or block produces NaN instead of a plausible number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}


@dataclass
class Batch:
    query: mx.array
    key_cache: mx.array
    value_cache: mx.array
    block_tables: mx.array
    seq_lens: mx.array
    cu_seqlens_q: mx.array
    q_lens: list[int]
    ctx_lens: list[int]

    @property
    def args(self) -> tuple[mx.array, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
        )


def make_batch(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: str = "float32",
    query_scale: float = 1.0,
    spare_blocks: int = 2,
    extra_tokens: int = 0,
) -> Batch:
    """A varlen batch: sequence s has q_lens[s] new tokens and ctx_lens[s] keys in total.

    Blocks are assigned in a random order; block table padding points at a NaN block.
    ``extra_tokens`` appends query rows that belong to no sequence (batch padding).
    """
    assert len(q_lens) == len(ctx_lens)
    assert all(0 <= q <= c for q, c in zip(q_lens, ctx_lens))
    mx_dtype = DTYPES[dtype]
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    order = rng.permutation(num_blocks)
    poison_block = int(order[-1])
    max_blocks = max(blocks_per_seq + [1]) + 1

    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    tables = np.full((len(q_lens), max_blocks), poison_block, np.int32)
    next_block = 0
    for s, ctx in enumerate(ctx_lens):
        for b in range(blocks_per_seq[s]):
            block = int(order[next_block])
            next_block += 1
            tables[s, b] = block
            used = min(block_size, ctx - b * block_size)
            k[block, :used] = rng.standard_normal((used, num_kv_heads, head_size))
            v[block, :used] = rng.standard_normal((used, num_kv_heads, head_size))

    num_tokens = sum(q_lens) + extra_tokens
    q = rng.standard_normal((num_tokens, num_heads, head_size)).astype(np.float32) * query_scale
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    batch = Batch(
        query=mx.array(q).astype(mx_dtype),
        key_cache=mx.array(k).astype(mx_dtype),
        value_cache=mx.array(v).astype(mx_dtype),
        block_tables=mx.array(tables),
        seq_lens=mx.array(np.asarray(ctx_lens, np.int32)),
        cu_seqlens_q=mx.array(cu),
        q_lens=list(q_lens),
        ctx_lens=list(ctx_lens),
    )
    mx.eval(*batch.args)
    return batch


def poison_allocator(nbytes: int) -> None:
    """Leaves a NaN-filled buffer of ``nbytes`` in MLX's buffer cache, so the next allocation of
    that size (an op's output) starts as NaN rather than zeros."""
    x = mx.full((max(1, nbytes // 4),), mx.nan, dtype=mx.float32)
    mx.eval(x)
    del x


def to_numpy(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


def assert_close(actual: mx.array, expected: mx.array, dtype: str) -> None:
    tol = TOLERANCE[dtype]
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape
    assert np.isfinite(a).all(), "output contains NaN/inf (read of poisoned memory?)"
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol if dtype != "float32" else 1e-5)
