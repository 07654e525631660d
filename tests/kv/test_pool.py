"""The KV pool follows vLLM's allocation plan: layers of different KV-cache groups that vLLM
overlays share one region, each layer reads its own group's block table, and block copies move
whole blocks in every region."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal import ops
from vllm_metal.kv import KV_CACHE_LAYOUT
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.kv.spec import kv_cache_specs
from vllm_metal.models.layers import FULL_ATTENTION, STATE, LayerKind


def test_copy_blocks_copies_every_region_and_leaves_others():
    pool = KVPool(KVLayout.single_group(3, 6, 8), num_kv_heads=2, head_dim=64, dtype=mx.float32)
    rng = np.random.default_rng(0)
    for r in range(3):
        pool.keys[r] = mx.array(rng.standard_normal((6, 8, 2, 64)).astype(np.float32))
        pool.values[r] = mx.array(rng.standard_normal((6, 8, 2, 64)).astype(np.float32))
    before_k = [np.array(a) for a in pool.keys]
    before_v = [np.array(a) for a in pool.values]
    pool.copy_blocks([1, 4], [3, 0])
    for r in range(3):
        k, v = np.array(pool.keys[r]), np.array(pool.values[r])
        np.testing.assert_array_equal(k[3], before_k[r][1])
        np.testing.assert_array_equal(k[0], before_k[r][4])
        np.testing.assert_array_equal(v[3], before_v[r][1])
        np.testing.assert_array_equal(v[0], before_v[r][4])
        for untouched in (1, 2, 4, 5):
            np.testing.assert_array_equal(k[untouched], before_k[r][untouched])
            np.testing.assert_array_equal(v[untouched], before_v[r][untouched])


@pytest.fixture(scope="module")
def engine_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=str(tiny_model_dir("qwen3")), max_model_len=256
    ).create_engine_config()
    config.cache_config.kv_cache_layout = KV_CACHE_LAYOUT
    return config


def _vllm_plan(engine_config, kinds: list[LayerKind], available: int):
    """vLLM's own grouping and allocation plan for layers of these kinds."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    names = [f"model.layers.{i}.self_attn" for i in range(len(kinds))]
    specs = kv_cache_specs(
        names, kinds, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32
    )
    groups = get_kv_cache_groups(engine_config, specs)
    return names, specs, get_kv_cache_config_from_groups(engine_config, groups, available)


def test_sliding_and_full_layers_share_regions_as_vllm_overlays_them(engine_config):
    sliding = LayerKind(sliding_window=32)
    kinds = [sliding, FULL_ATTENTION, sliding, FULL_ATTENTION]
    names, specs, config = _vllm_plan(engine_config, kinds, available=64 * 2**20)
    assert len(config.kv_cache_groups) == 2  # vLLM keeps the window: one group per kind

    layout = KVLayout.from_config(config, names)
    group_of = {n: g for g, grp in enumerate(config.kv_cache_groups) for n in grp.layer_names}
    assert layout.group_of_layer == tuple(group_of[n] for n in names)
    assert layout.num_regions == 2  # two layers per group, overlaid
    for r in range(layout.num_regions):
        sharing = [i for i, reg in enumerate(layout.region_of_layer) if reg == r]
        assert len({layout.group_of_layer[i] for i in sharing}) == len(sharing)

    pool = KVPool(layout, num_kv_heads=2, head_dim=64, dtype=mx.float32)
    page = next(iter(specs.values())).page_size_bytes
    assert pool.nbytes == layout.num_regions * config.num_blocks * page <= 64 * 2**20


def test_uniform_model_gets_one_region_per_layer(engine_config):
    names, _, config = _vllm_plan(engine_config, [FULL_ATTENTION] * 3, available=16 * 2**20)
    layout = KVLayout.from_config(config, names)
    assert layout.region_of_layer == (0, 1, 2)
    assert layout.group_of_layer == (0, 0, 0)


def test_layers_vllm_did_not_plan_are_an_error(engine_config):
    names, _, config = _vllm_plan(engine_config, [FULL_ATTENTION] * 2, available=16 * 2**20)
    with pytest.raises(ValueError, match="no memory for layers"):
        KVLayout.from_config(config, [*names, "model.layers.9.self_attn"])


def test_a_state_layer_needs_its_shapes_and_the_cache_config():
    with pytest.raises(ValueError, match="state layer needs its shapes"):
        kv_cache_specs(
            ["a"], [STATE], block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32
        )


@pytest.mark.skipif(not ops.native_available(), reason="needs _C")
@pytest.mark.parametrize("latent", [False, True], ids=["kv", "latent"])
def test_pool_pages_are_committed_only_as_they_are_written(latent):
    """512 MiB of pool raise the resident set by what is written (the zeroed null block, then
    one block), not by the pool's size; the null block reads zeros, a written block its rows."""
    import psutil

    process = psutil.Process()
    heads, dim = (1, 512) if latent else (8, 128)
    before = process.memory_info().rss
    # 2 layers x 8192 blocks x 16 tokens x 8 heads x 128 x 2 bytes, K and V: 512 MiB (the
    # latent pool: 2 x 8192 x 16 x 512 x 2 bytes, 256 MiB).
    pool = KVPool(KVLayout.single_group(2, 8192, 16), heads, dim, mx.float16, latent=latent)
    allocated = process.memory_info().rss - before
    assert pool.nbytes >= 256 * 2**20
    assert allocated < 16 * 2**20, allocated / 2**20
    assert not np.array(pool.keys[1][0].astype(mx.float32)).any()

    rows = mx.ones((16, dim) if latent else (16, heads, dim), dtype=mx.float16)
    slots = mx.arange(16 * 7, 16 * 8, dtype=mx.int64)
    if latent:
        pool.keys[0] = ops.mla_reshape_and_cache(rows, pool.keys[0], slots)
    else:
        pool.keys[0], pool.values[0] = ops.reshape_and_cache(
            rows, rows, pool.keys[0], pool.values[0], slots
        )
    assert (np.array(pool.keys[0][7].astype(mx.float32)) == 1).all()
    assert process.memory_info().rss - before < 24 * 2**20


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "reference"])
@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head"])
def test_padded_pages_keep_each_layers_rows_apart(engine_config, monkeypatch, dtype, reference_ops):
    """Gemma 4's two head sizes under a per-token-head cache: with each row's scale beside it a
    sliding layer's page (2 heads of 32) and a full layer's (1 head of 64) are no whole multiple
    of each other, so vLLM pads the smaller to the larger and overlays the two in one region. Each
    layer writes its blocks through its view of the region (the native op in place; the MLX one
    returns new pages, copied back) and reads back exactly what pools of its own shape hold."""
    from dataclasses import replace

    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from vllm_metal.kv.quant import PerTokenHeadCache

    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    sliding = LayerKind(sliding_window=32)
    full = LayerKind(num_kv_heads=1, head_dim=64)
    kinds = [sliding, full]
    names = [f"model.layers.{i}.self_attn" for i in range(2)]
    cache_config = replace(engine_config.cache_config, cache_dtype=dtype)
    specs = kv_cache_specs(
        names, kinds, block_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32,
        cache_config=cache_config,
    )  # fmt: skip
    pages = sorted(spec.page_size_bytes for spec in specs.values())
    assert pages[1] % pages[0]  # no whole multiple: vLLM pads
    groups = get_kv_cache_groups(engine_config, specs)
    plan = get_kv_cache_config_from_groups(engine_config, groups, 64 * pages[1])
    assert {group.kv_cache_spec.page_size_bytes for group in plan.kv_cache_groups} == {pages[1]}
    layout = KVLayout.from_config(plan, names)
    assert layout.region_of_layer == (0, 0)  # overlaid
    quant = PerTokenHeadCache(dtype).layer_reads(kinds)
    pool = KVPool(layout, 2, 32, mx.float32, layer_shapes=[(2, 32), (1, 64)], layer_quant=quant)
    assert pool.nbytes == plan.num_blocks * pages[1]  # what vLLM sized, padding included

    rng = np.random.default_rng(1)
    blocks = {0: [1, 3], 1: [2, 4]}  # block ids are one group's at a time
    own = {}
    for round_ in range(2):  # the layers' writes interleave
        for layer, kind in enumerate(kinds):
            heads, head_dim = kind.kv_shape(2, 32)
            shape = (16, *pool.stored_shape(heads, head_dim))
            if layer not in own:
                own[layer] = [mx.zeros((layout.num_blocks, *shape), mx.uint8) for _ in "kv"]
            rows = [mx.array(rng.standard_normal((16, heads, head_dim)), mx.float32) for _ in "kv"]
            slots = mx.arange(16, dtype=mx.int64) + 16 * blocks[layer][round_]
            views = [KVPool.page_view(a[0], *shape) for a in (pool.keys, pool.values)]
            kc, vc = ops.reshape_and_cache(*rows, *views, slots, kv_cache_dtype=dtype)
            in_place = functools.partial(ops.cache.writes_in_place, head_dim, dtype)
            assert in_place() is not reference_ops
            pool.keys[0] = KVPool.written(pool.keys[0], kc, in_place)
            pool.values[0] = KVPool.written(pool.values[0], vc, in_place)
            own[layer] = list(
                ops.reshape_and_cache(*rows, *own[layer], slots, kv_cache_dtype=dtype)
            )
    mx.eval(pool.arrays())
    for layer, kind in enumerate(kinds):
        shape = (16, *pool.stored_shape(*kind.kv_shape(2, 32)))
        for arrays, mine in zip((pool.keys, pool.values), own[layer]):
            got = np.array(KVPool.page_view(arrays[0], *shape))[blocks[layer]]
            np.testing.assert_array_equal(got, np.array(mine)[blocks[layer]])
