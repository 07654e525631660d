"""The KV offload's moving parts without an engine: block copies between the MLX pool and the
host pool (every region of every KV-cache group), the disk tier under it (read back by a fresh
worker, a corrupt file reported as a load error), and the scheduler-side manager's split of a
load between host chunks and disk files."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, ReqContext, make_offload_key
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_metal.kv.offload.disk import DiskTier
from vllm_metal.kv.offload.manager import DISK_HITS, HOST_HITS, ON_DISK, HostDiskManager, TierSpec
from vllm_metal.kv.offload.transfer import MLXTransfer
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.ops.fp8 import FORMATS, KVQuant
from vllm_metal.ops.per_token_head import PerTokenHeadQuant

BLOCK, HEADS, DIM = 4, 2, 8
# Two KV-cache groups (e.g. sliding-window and full layers) overlaid on two regions, as vLLM
# plans it: layers 0 and 1 share region 0, layers 2 and 3 region 1.
LAYOUT = KVLayout(
    num_blocks=8, block_size=BLOCK, region_of_layer=(0, 0, 1, 1), group_of_layer=(0, 1, 0, 1)
)


def _random_pool(dtype=mx.bfloat16, seed: int = 0) -> KVPool:
    """A pool of random rows; dtype "fp8": an fp8 cache's pool (`kv.quant`) of random bytes, a
    per-token-head format's name: its pool of random bytes (rows of data and a scale)."""
    fp8 = isinstance(dtype, str)
    layer = KVQuant(FORMATS["fp8_e4m3"]) if dtype == "fp8" else PerTokenHeadQuant(dtype)
    quant = [layer] * len(LAYOUT.region_of_layer) if fp8 else None
    pool = KVPool(LAYOUT, HEADS, DIM, mx.bfloat16 if fp8 else dtype, layer_quant=quant)
    rng = np.random.default_rng(seed)
    shape = pool.keys[0].shape
    for arrays in (pool.keys, pool.values):
        for r in range(len(arrays)):
            if fp8:
                arrays[r] = mx.array(rng.integers(0, 256, shape, dtype=np.uint8))
            else:
                arrays[r] = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return pool


def _blocks(pool: KVPool, ids: list[int]) -> list[np.ndarray]:
    idx = mx.array(ids)
    return [np.array(a[idx].astype(mx.float32)) for a in (*pool.keys, *pool.values)]


def _finish(transfer: MLXTransfer, job_ids: set[int]) -> None:
    done: set[int] = set()
    deadline = time.monotonic() + 30
    while done != job_ids and time.monotonic() < deadline:
        for result in transfer.get_finished():
            assert result.success
            done.add(result.job_id)
        time.sleep(0.01)
    assert done == job_ids


def _gpu(ids_per_group: list[list[int]], first_block: int = 0) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(
        [b for ids in ids_per_group for b in ids],
        [len(ids) for ids in ids_per_group],
        [first_block] * len(ids_per_group),
    )


KEYS = [make_offload_key(bytes([i]) * 32, g) for i, g in ((1, 0), (2, 0), (3, 1))]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32, "fp8", "int8_per_token_head"])
def test_blocks_go_to_the_host_and_come_back_into_other_blocks(dtype):
    """Per-token-head pools: each row's scale is in its page, so it moves with the row's data."""
    pool = _random_pool(dtype)
    assert pool.dtype == (mx.uint8 if isinstance(dtype, str) else dtype)
    source = _blocks(pool, [1, 2, 5])
    transfer = MLXTransfer(pool, [0, 1], num_chunks=4, disk=None)
    assert transfer.regions == [[0, 1], [0, 1]]
    transfer.submit_store(7, _gpu([[1, 2], [5]]), TierSpec([0, 3, 1], KEYS))
    _finish(transfer, {7})

    # The pool is overwritten (a new allocation after sleep, or blocks reused); load into 3, 4, 6.
    zeros = np.zeros(pool.keys[0].shape, np.float32)
    for arrays in (pool.keys, pool.values):
        for r in range(len(arrays)):
            arrays[r] = mx.array(zeros).astype(pool.dtype)
    transfer.submit_load(8, TierSpec([0, 3, 1], KEYS), _gpu([[3, 4], [6]]))
    _finish(transfer, {8})
    assert transfer.take_load_errors() == set()
    for got, want in zip(_blocks(pool, [3, 4, 6]), source):
        np.testing.assert_array_equal(got, want)
    for untouched in _blocks(pool, [0, 1, 2, 5, 7]):
        assert not untouched.any()
    transfer.shutdown()


def test_turboquant_slots_and_float_pages_move_as_their_bytes():
    """A TurboQuant pool: region 0 holds a boundary layer's float pages, region 1 key and value
    slots of two other widths (`kv.turboquant`); a block comes back byte for byte."""
    from vllm_metal.kv.turboquant import TurboQuantPool, format_for

    fmt = format_for("turboquant_3bit_nc", DIM)
    assert fmt.key_bytes != fmt.value_bytes
    pool = TurboQuantPool(
        LAYOUT, HEADS, DIM, mx.float32, [None, None, fmt, fmt], [(HEADS, DIM)] * 4
    )
    assert pool.keys[0].dtype == mx.float32 and pool.keys[1].dtype == mx.uint8
    rng = np.random.default_rng(3)
    for arrays in (pool.keys, pool.values):
        for r, a in enumerate(arrays):
            raw = rng.integers(0, 256, (*a.shape[:-1], a.shape[-1] * a.dtype.size), np.uint8)
            arrays[r] = mx.view(mx.array(raw), a.dtype)

    def block_bytes(ids):
        idx = mx.array(ids)
        return [np.array(mx.view(a[idx], mx.uint8)) for a in (*pool.keys, *pool.values)]

    source = block_bytes([1, 2, 5])
    transfer = MLXTransfer(pool, [0, 1], num_chunks=4, disk=None)
    transfer.submit_store(7, _gpu([[1, 2], [5]]), TierSpec([0, 3, 1], KEYS))
    _finish(transfer, {7})
    transfer.submit_load(8, TierSpec([0, 3, 1], KEYS), _gpu([[3, 4], [6]]))
    _finish(transfer, {8})
    for got, want in zip(block_bytes([3, 4, 6]), source):
        np.testing.assert_array_equal(got, want)
    transfer.shutdown()


def test_the_disk_tier_outlives_the_host_pool_and_never_serves_a_corrupt_file(tmp_path):
    pool = _random_pool()
    source = _blocks(pool, [1, 2, 5])
    disk = DiskTier(tmp_path, "ns", 1 << 20)
    transfer = MLXTransfer(pool, [0, 1], num_chunks=4, disk=disk)
    transfer.submit_store(1, _gpu([[1, 2], [5]]), TierSpec([0, 1, 2], KEYS))
    _finish(transfer, {1})
    transfer.drain_disk_writes()
    transfer.shutdown()
    assert all(disk.contains(key) for key in KEYS)

    # A restarted server: a new pool, an empty host pool, the same directory.
    pool = KVPool(LAYOUT, HEADS, DIM, mx.bfloat16)
    transfer = MLXTransfer(pool, [0, 1], num_chunks=4, disk=DiskTier(tmp_path, "ns", 1 << 20))
    transfer.submit_load(2, TierSpec([ON_DISK] * 3, KEYS), _gpu([[3, 4], [6]]))
    _finish(transfer, {2})
    assert transfer.take_load_errors() == set()
    for got, want in zip(_blocks(pool, [3, 4, 6]), source):
        np.testing.assert_array_equal(got, want)

    # One byte flipped in the second block's file: that block is a load error, the others load.
    path = transfer.disk.path(KEYS[1])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    pool = KVPool(LAYOUT, HEADS, DIM, mx.bfloat16)  # its contents start undefined: zero them
    for arrays in (pool.keys, pool.values):
        arrays[:] = [mx.zeros_like(a) for a in arrays]
    transfer.pool = pool
    transfer.submit_load(3, TierSpec([ON_DISK] * 3, KEYS), _gpu([[3, 4], [6]]))
    _finish(transfer, {3})
    assert transfer.take_load_errors() == {4}
    got = _blocks(pool, [3, 4, 6])
    for g, w in zip(got, source):
        np.testing.assert_array_equal(g[[0, 2]], w[[0, 2]])
        assert not g[1].any()  # never written from the corrupt file
    assert not path.exists()
    assert transfer.counters.disk_blocks_failed == 1
    transfer.shutdown()


def test_the_manager_loads_from_host_chunks_and_disk_files(tmp_path):
    disk = DiskTier(tmp_path, "ns", 1 << 20)
    manager = HostDiskManager(disk=DiskTier(tmp_path, "ns", 1 << 20, writer=False), num_chunks=2)
    ctx = ReqContext("r1")
    manager.on_new_request(ctx)
    stored = manager.prepare_store(KEYS[:2], ctx)
    assert isinstance(stored.store_spec, TierSpec) and stored.store_spec.keys == KEYS[:2]
    manager.complete_store(KEYS[:2], ctx)
    disk.write(KEYS[2], np.zeros(16, np.uint8))  # only on disk (evicted from the host pool)

    assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.HIT] * 3
    missing = make_offload_key(b"\x09" * 32, 0)
    assert manager.lookup(missing, ctx) is LookupResult.MISS
    sources = [manager.get_load_source(k, ctx) for k in KEYS]
    assert sources == [CacheHitSource.HOST, CacheHitSource.HOST, CacheHitSource.DISK]

    spec = manager.prepare_load(KEYS, ctx)
    assert isinstance(spec, TierSpec) and spec.keys == KEYS
    chunks = spec.block_ids.tolist()
    assert chunks[2] == ON_DISK and sorted(chunks[:2]) == [0, 1]
    # While loading, host chunks cannot be evicted to store new blocks.
    others = [make_offload_key(bytes([i]) * 32, 0) for i in (7, 8)]
    assert manager.prepare_store(others, ctx) is None
    manager.complete_load(KEYS, ctx)
    assert manager.prepare_store(others, ctx) is not None

    stats = manager.get_stats()
    reduced = stats.reduce()
    assert reduced[HOST_HITS] == 2 and reduced[DISK_HITS] == 1

    # vLLM's prefix-cache reset (with the connector) forgets both tiers.
    manager.reset_cache()
    assert [manager.lookup(k, ctx) for k in KEYS] == [LookupResult.MISS] * 3
    assert disk.write(KEYS[2], np.ones(16, np.uint8))  # the writer's index noticed
    assert manager.lookup(KEYS[2], ctx) is LookupResult.HIT
