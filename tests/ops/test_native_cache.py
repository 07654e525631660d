"""The native reshape_and_cache writes exactly the reference's rows, in place, skipping padding
slots, for every dtype and layout; and a cache write feeds attention within one lazy graph.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import DTYPES, make_batch, to_numpy

from vllm_metal import ops
from vllm_metal.ops import reference


def random_pools(
    rng: np.random.Generator, shape: tuple[int, ...], dtype: str
) -> tuple[mx.array, ...]:
    # Large, distinctive values: any row the op wrongly touches or leaves out shows up.
    pools = [
        mx.array((rng.standard_normal(shape) * 1e3).astype(np.float32)).astype(DTYPES[dtype])
        for _ in range(2)
    ]
    mx.eval(*pools)
    return tuple(pools)


def rows(rng: np.random.Generator, num_tokens: int, heads: int, head_size: int, dtype: str):
    k = mx.array(rng.standard_normal((num_tokens, heads, head_size)).astype(np.float32))
    v = mx.array(rng.standard_normal((num_tokens, heads, head_size)).astype(np.float32))
    return k.astype(DTYPES[dtype]), v.astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_writes_match_reference_and_skip_padding(
    native: ModuleType, dtype: str, block_size: int
) -> None:
    rng = np.random.default_rng(block_size)
    num_blocks, heads, head_size = 9, 2, 128
    num_slots = num_blocks * block_size
    kc, vc = random_pools(rng, (num_blocks, block_size, heads, head_size), dtype)
    slots = rng.choice(num_slots, size=20, replace=False).astype(np.int64)
    slots[[2, 7, 8, 19]] = -1  # padding
    key, value = rows(rng, len(slots), heads, head_size, dtype)
    slot_mapping = mx.array(slots)

    want_k, want_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    mx.eval(want_k, want_v)
    before_k = np.asarray(kc.astype(mx.float32)).copy()
    got_k, got_v = native.reshape_and_cache(key, value, kc, vc, slot_mapping)
    mx.eval(got_k, got_v)
    np.testing.assert_array_equal(to_numpy(got_k), to_numpy(want_k))
    np.testing.assert_array_equal(to_numpy(got_v), to_numpy(want_v))
    # Rows of padding tokens went nowhere: only the valid slots changed.
    changed = np.nonzero((to_numpy(got_k) != before_k).any(axis=(2, 3)).reshape(-1))[0]
    assert set(changed.tolist()) <= set(slots[slots >= 0].tolist())


def test_write_is_in_place(native: ModuleType) -> None:
    rng = np.random.default_rng(1)
    kc, vc = random_pools(rng, (4, 16, 2, 64), "float32")
    key, value = rows(rng, 3, 2, 64, "float32")
    new_k, new_v = native.reshape_and_cache(key, value, kc, vc, mx.array(np.array([5, 17, 63])))
    mx.eval(new_k, new_v)
    # The returned pools share the inputs' memory: the old handles see the rows too.
    np.testing.assert_array_equal(np.asarray(kc[0, 5]), np.asarray(key[0]))
    np.testing.assert_array_equal(np.asarray(vc[3, 15]), np.asarray(value[2]))
    np.testing.assert_array_equal(np.asarray(new_k), np.asarray(kc))


def test_broadcast_pool_is_materialised(native: ModuleType) -> None:
    rng = np.random.default_rng(2)
    # One row broadcast over the whole pool: writing through it would change every slot.
    kc = mx.broadcast_to(mx.zeros((1, 1, 1, 64)), (3, 8, 2, 64))
    vc = mx.broadcast_to(mx.zeros((1, 1, 1, 64)), (3, 8, 2, 64))
    key, value = rows(rng, 2, 2, 64, "float32")
    new_k, new_v = native.reshape_and_cache(key, value, kc, vc, mx.array(np.array([0, 23])))
    want_k, _ = reference.reshape_and_cache(key, value, kc, vc, mx.array(np.array([0, 23])))
    np.testing.assert_array_equal(np.asarray(new_k), np.asarray(want_k))
    assert float(mx.abs(new_v[0, 1:]).max()) == 0.0
    assert float(mx.abs(kc).max()) == 0.0


def test_strided_rows_and_pool_slice(native: ModuleType) -> None:
    rng = np.random.default_rng(3)
    # Rows cut out of a fused projection, pools a layer slice of a [NB, BS, layers, H, D] array.
    fused = mx.array(rng.standard_normal((6, 3, 2, 64)).astype(np.float32))
    key, value = fused[:, 1], fused[:, 2]
    big_k = mx.array(rng.standard_normal((5, 8, 3, 2, 64)).astype(np.float32))
    big_v = mx.array(rng.standard_normal((5, 8, 3, 2, 64)).astype(np.float32))
    kc, vc = big_k[:, :, 1], big_v[:, :, 1]
    mx.eval(key, value, kc, vc)
    slot_mapping = mx.array(np.array([0, 39, -1, 12, 7, 20], np.int64))
    want_k, want_v = reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    mx.eval(want_k, want_v)
    got_k, got_v = native.reshape_and_cache(key, value, kc, vc, slot_mapping)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    # Written in place through the slice: the big allocation holds the rows.
    np.testing.assert_array_equal(np.asarray(big_k[4, 7, 1]), np.asarray(key[1]))


def test_large_write_uses_threads_and_matches(native: ModuleType) -> None:
    rng = np.random.default_rng(4)
    kc, vc = random_pools(rng, (64, 32, 4, 128), "bfloat16")
    slots = rng.permutation(64 * 32)[:1500].astype(np.int64)
    slots[::50] = -1
    key, value = rows(rng, len(slots), 4, 128, "bfloat16")
    want_k, want_v = reference.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    mx.eval(want_k, want_v)
    got_k, got_v = native.reshape_and_cache(key, value, kc, vc, mx.array(slots))
    np.testing.assert_array_equal(to_numpy(got_k), to_numpy(want_k))
    np.testing.assert_array_equal(to_numpy(got_v), to_numpy(want_v))


def test_cache_write_then_attention_in_one_graph(native: ModuleType) -> None:
    """A runner step: write this step's K/V, then attend, with a single eval at the end."""
    rng = np.random.default_rng(5)
    batch = make_batch(
        rng,
        q_lens=[1, 4],
        ctx_lens=[21, 4],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=8,
    )
    tables = np.asarray(batch.block_tables)
    positions = [(0, 20)] + [(1, p) for p in range(4)]
    slots = np.array([tables[s, p // 8] * 8 + p % 8 for s, p in positions], np.int64)
    key, value = rows(rng, len(slots), 2, 64, "float32")

    ref_k, ref_v = reference.reshape_and_cache(
        key, value, batch.key_cache, batch.value_cache, mx.array(slots)
    )
    ref_args = (batch.query, ref_k, ref_v, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    want = reference.paged_attention(*ref_args, scale=0.125)
    mx.eval(want)

    k_pool, v_pool = ops.reshape_and_cache(
        key, value, batch.key_cache, batch.value_cache, mx.array(slots)
    )
    out = ops.paged_attention(
        batch.query,
        k_pool,
        v_pool,
        batch.block_tables,
        batch.seq_lens,
        batch.cu_seqlens_q,
        scale=0.125,
    )
    mx.eval(out)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-5)
