"""State pages of hybrid models: a state layer's pages live in the K/V pools of the region it
shares with attention layers (the latent rows alone beside MLA layers), bytes as they are; a step reads the page where the previous step
left the state and writes the page of its last token (vLLM's "align" mode with prefix caching,
one page per request without); the platform sizes KV blocks so a block holds a page and pads
vLLM's state page to the attention page; what the hybrid path does not run is refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.kv.state import StateBlocks, StateLayerCache
from vllm_metal.models.layers import StateShapes

SHAPES = StateShapes(conv=(3, 40), recurrent=(2, 8, 16))  # 1024 bytes + 120 conv elements
# A state larger than a block's K rows (2048 bytes in float16), so it runs on into the V rows,
# and an odd number of conv elements (123: half a word left over in float16).
SPANNING = StateShapes(conv=(3, 41), recurrent=(4, 8, 16))


def _pool(dtype=mx.float16, num_blocks: int = 5) -> KVPool:
    # One page: 2 * 16 tokens * 2 heads * 32 dims * 2 bytes = 4096 bytes (8192 in float32).
    return KVPool(KVLayout.single_group(1, num_blocks, 16), 2, 32, dtype)


def _bytes(a: mx.array) -> np.ndarray:
    return np.array(mx.view(a, mx.uint8))


def _cache(pool, blocks, fresh, shapes=SHAPES, write=None) -> StateLayerCache:
    cu = mx.array(np.arange(len(blocks) + 1, dtype=np.int32))
    read = np.array(blocks)
    pages = StateBlocks(
        read=read,
        write=np.array(blocks if write is None else write),
        fresh=np.array(fresh),
        table=read[:, None],
        computed=np.zeros(len(blocks), dtype=np.int64),
        block_size=16,
    )
    return StateLayerCache(pool, 0, shapes, pages, cu)


@pytest.mark.parametrize("shapes", [SHAPES, SPANNING], ids=["k_rows", "k_and_v_rows"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_pages_round_trip_bit_for_bit_and_leave_other_blocks(dtype, shapes):
    pool = _pool(dtype)
    rng = np.random.default_rng(0)
    # Arbitrary bit patterns, NaN payloads included: pages are bytes, never converted.
    bits = rng.integers(0, 2**32, size=(2, *shapes.recurrent), dtype=np.uint32)
    recurrent = mx.view(mx.array(bits), mx.float32)
    conv = mx.array(rng.standard_normal((2, *shapes.conv)).astype(np.float32)).astype(dtype)
    before_k, before_v = _bytes(pool.keys[0]), _bytes(pool.values[0])

    _cache(pool, [3, 1], [False, False], shapes).write(conv, recurrent)
    got_conv, got_recurrent = _cache(pool, [1, 3], [False, False], shapes).read()

    np.testing.assert_array_equal(np.array(mx.view(got_recurrent, mx.uint32)), bits[::-1])
    np.testing.assert_array_equal(_bytes(got_conv), _bytes(conv)[::-1])
    for b in (0, 2, 4):
        np.testing.assert_array_equal(_bytes(pool.keys[0])[b], before_k[b])
        np.testing.assert_array_equal(_bytes(pool.values[0])[b], before_v[b])


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_pages_round_trip_in_a_latent_pool(dtype):
    """A latent (MLA) pool has one array per region and no values: the page is its K rows."""
    # One page: 16 tokens * 48 dims * 2 bytes = 1536 bytes in float16 (SHAPES takes 1264).
    pool = KVPool(KVLayout.single_group(1, 5, 16), 1, 48, dtype, latent=True)
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, size=(2, *SHAPES.recurrent), dtype=np.uint32)
    recurrent = mx.view(mx.array(bits), mx.float32)
    conv = mx.array(rng.standard_normal((2, *SHAPES.conv)).astype(np.float32)).astype(dtype)
    before = _bytes(pool.keys[0])

    _cache(pool, [3, 1], [False, False]).write(conv, recurrent)
    got_conv, got_recurrent = _cache(pool, [1, 3], [False, False]).read()

    assert pool.values == []
    np.testing.assert_array_equal(np.array(mx.view(got_recurrent, mx.uint32)), bits[::-1])
    np.testing.assert_array_equal(_bytes(got_conv), _bytes(conv)[::-1])
    for b in (0, 2, 4):
        np.testing.assert_array_equal(_bytes(pool.keys[0])[b], before[b])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int4_per_token_head"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_pages_round_trip_in_a_quantized_pool(kv_cache_dtype, dtype):
    """Beside a quantized cache the pool holds bytes (`kv.quant`), its attention rows quantized;
    a state page is stored as it is, never quantized, its window in the model's dtype."""
    from vllm_metal.kv.quant import kv_cache_quant
    from vllm_metal.models.layers import STATE

    quant = kv_cache_quant(kv_cache_dtype, 1).layer_reads([STATE])
    # int4 rows of 32: 16 bytes + a 4-byte scale; one page 2 * 16 * 4 heads * 20 = 2560 bytes,
    # which SHAPES (1,504 bytes in float32) fills past its K rows.
    pool = KVPool(KVLayout.single_group(1, 5, 16), 4, 32, dtype, layer_quant=quant)
    assert pool.dtype == mx.uint8 and pool.row_dtype == dtype
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, size=(2, *SHAPES.recurrent), dtype=np.uint32)
    recurrent = mx.view(mx.array(bits), mx.float32)
    conv = mx.array(rng.standard_normal((2, *SHAPES.conv)).astype(np.float32)).astype(dtype)
    before_k = _bytes(pool.keys[0])

    _cache(pool, [3, 1], [False, False]).write(conv, recurrent)
    got_conv, got_recurrent = _cache(pool, [1, 3], [False, False]).read()

    assert got_conv.dtype == dtype
    np.testing.assert_array_equal(np.array(mx.view(got_recurrent, mx.uint32)), bits[::-1])
    np.testing.assert_array_equal(_bytes(got_conv), _bytes(conv)[::-1])
    for b in (0, 2, 4):
        np.testing.assert_array_equal(_bytes(pool.keys[0])[b], before_k[b])


def test_fresh_requests_read_zeros_whatever_their_block_holds():
    pool = _pool()
    ones_r = mx.ones((2, *SHAPES.recurrent), dtype=mx.float32)
    ones_c = mx.ones((2, *SHAPES.conv), dtype=mx.float16)
    _cache(pool, [0, 2], [False, False]).write(ones_c, ones_r)
    conv, recurrent = _cache(pool, [0, 2], [True, False]).read()
    assert not np.array(recurrent[0]).any() and not np.array(conv[0].astype(mx.float32)).any()
    assert (np.array(recurrent[1]) == 1).all() and (np.array(conv[1].astype(mx.float32)) == 1).all()


def test_a_step_reads_one_page_and_writes_another_leaving_the_first_as_it_was():
    """Align mode: the boundary state in block 1 stays for prefix hits while the request goes
    on in block 3."""
    pool = _pool()
    boundary_r = mx.full((1, *SHAPES.recurrent), 2.0, dtype=mx.float32)
    boundary_c = mx.full((1, *SHAPES.conv), 3.0, dtype=mx.float16)
    _cache(pool, [1], [False]).write(boundary_c, boundary_r)
    cache = _cache(pool, [1], [False], write=[3])
    conv, recurrent = cache.read()
    cache.write(conv + 1, recurrent * 2)
    kept_c, kept_r = _cache(pool, [1], [False]).read()
    moved_c, moved_r = _cache(pool, [3], [False]).read()
    assert (np.array(kept_r) == 2).all() and (np.array(kept_c.astype(mx.float32)) == 3).all()
    assert (np.array(moved_r) == 4).all() and (np.array(moved_c.astype(mx.float32)) == 4).all()


def test_state_pages_of_a_step_follow_the_block_of_the_last_token():
    # Block size 4. Rows: a fresh prompt chunk of 8 tokens; a chunk from a prefix hit of 8 to
    # 11; a decode step that crosses into block 2 (computed 8 -> 9); a decode inside block 1
    # (6 -> 7).
    table = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]])
    computed = np.array([0, 8, 8, 6])
    seq_lens = np.array([8, 11, 9, 7])
    pages = StateBlocks.of_step(table, 4, computed, seq_lens)
    assert pages.read.tolist()[1:] == [21, 31, 41]
    assert pages.write.tolist() == [11, 22, 32, 41]
    assert pages.fresh.tolist() == [True, False, False, False]
    # One block per request (block size max_model_len): read and write the same page.
    single = StateBlocks.of_step(table[:, :1], 256, computed, seq_lens)
    assert single.read.tolist() == single.write.tolist() == [10, 20, 30, 40]


# ----------------------------------------------------------------- startup (vLLM's config)


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = {"max_model_len": 256, "dtype": "float32", **kwargs}
    return EngineArgs(model=str(model), **args).create_engine_config()


@pytest.mark.parametrize(
    ("family", "block_size"),
    # State page: Qwen3-Next 2 value heads x 64 x 64 float32 + 3 x 256 conv window float32 =
    # 35,840 bytes; Granite 4.0-H 4 heads x 32 x 32 float32 + 3 x 256 = 19,456 bytes. An
    # attention token is 2 x 1 KV head x 64 x 4 bytes = 512: 70 -> 80 and 38 -> 48 tokens (16s).
    # Falcon-H1: 8 heads x 16 x 16 float32 + 3 x 192 = 10,496 bytes: 21 -> 32 tokens.
    [
        ("qwen3_next", 80),
        ("granitemoehybrid", 48),
        ("qwen3_5", 80),
        ("qwen3_5_moe", 80),
        ("falcon_h1", 32),
    ],
)
def test_blocks_hold_a_state_page_and_prefix_caching_saves_states_per_block(
    request, family, block_size
):
    from vllm_metal.config.kinds import kind_of

    model = request.getfixturevalue(f"tiny_{family}_dir")
    config = _engine_config(model, enable_prefix_caching=True)
    cache = config.cache_config
    assert kind_of(config).name == "state_hybrid"
    assert cache.block_size == block_size
    assert cache.mamba_page_size_padded == block_size * 512
    assert cache.enable_prefix_caching
    assert cache.mamba_cache_mode == "align" and cache.mamba_block_size == block_size

    off = _engine_config(model, enable_prefix_caching=False).cache_config
    assert off.block_size == block_size
    assert off.mamba_cache_mode == "none" and off.mamba_block_size == 256


def test_a_prefix_match_unit_inside_a_block_is_refused_by_name(tiny_qwen3_next_dir):
    with pytest.raises(ValueError, match="--prefix-match-unit 16"):
        _engine_config(tiny_qwen3_next_dir, enable_prefix_caching=True, prefix_match_unit=16)


def _vllm_state_spec(config):
    """The model class vLLM resolves for `config` and the state spec that class computes."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config, cache = config.model_config, config.cache_config
    cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    spec = MambaSpec(
        shapes=cls.get_mamba_state_shape_from_config(config),
        dtypes=cls.get_mamba_state_dtype_from_config(config),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
    )
    return cls, spec


def _our_state_spec(config):
    """`kv.state.mamba_spec` of the state shapes the runner keeps for `config`'s model."""
    import torch

    from vllm_metal.kv.state import mamba_spec
    from vllm_metal.models.layers import state_shapes_of

    text = config.model_config.hf_text_config
    shapes = state_shapes_of(text.model_type, text.to_dict())
    return mamba_spec(shapes, torch.float32, config.cache_config)


@pytest.mark.parametrize(
    ("layout", "multimodal"),
    [("wrapper", True), ("causal_lm", False), ("moe_wrapper", True), ("moe_causal_lm", False)],
)
def test_vllm_sizes_qwen3_5_state_pages_as_the_runner_lays_them_out(
    tiny_qwen3_5_dirs, layout, multimodal
):
    """vLLM inspects Qwen3.5 through the plugin's classes (`compat.vllm_models`, its own would
    import torchvision) and gets the state the runner keeps: the same page bytes and dtypes as
    `kv.state.mamba_spec` from `models.layers.STATE_SHAPES`, element for element."""
    import torch

    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_qwen3_5_dirs(layout))
    model_config, cache = config.model_config, config.cache_config
    assert kind_of(config).name == "state_hybrid" and model_config.is_hybrid
    # A wrapper is multimodal to vLLM and served as its language model (images are refused).
    assert model_config.is_multimodal_model is multimodal
    assert bool(multimodal and model_config.multimodal_config.language_model_only) is multimodal
    cls, vllm_spec = _vllm_state_spec(config)
    assert cls.__module__ == "vllm_metal.compat.vllm_models"
    ours = _our_state_spec(config)
    assert [math.prod(s) for s in vllm_spec.shapes] == [math.prod(s) for s in ours.shapes]
    assert vllm_spec.dtypes == ours.dtypes == (torch.float32, torch.float32)
    assert vllm_spec.page_size_bytes == ours.page_size_bytes == cache.block_size * 512


@pytest.mark.parametrize(
    ("kv_cache_dtype", "block_size", "token_bytes"),
    # The tiny Qwen3.5's one KV head of 64: fp8 K and V rows of 64 bytes, per-token-head rows
    # with a 4-byte scale (int8: 68, int4: 36); the 35,840-byte state page then needs 280 -> 288,
    # 263.5 -> 272 and 497.8 -> 512 tokens (multiples of 16).
    [("fp8", 288, 128), ("int8_per_token_head", 272, 136), ("int4_per_token_head", 512, 72)],
)
def test_quantized_attention_pages_hold_the_state_page(
    tiny_qwen3_5_dirs, kv_cache_dtype, block_size, token_bytes
):
    """With a quantized cache the platform sizes the block by the quantized attention page, pads
    the (float) state page to it, and vLLM's planner puts both in one block pool, which the pool
    lays out (`kv.state.align_block_size`)."""
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

    from vllm_metal.kv import KV_CACHE_LAYOUT
    from vllm_metal.kv.pool import pool_for
    from vllm_metal.kv.quant import kv_cache_quant
    from vllm_metal.kv.spec import kv_cache_specs
    from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, state_shapes_of

    config = _engine_config(tiny_qwen3_5_dirs("causal_lm"), kv_cache_dtype=kv_cache_dtype)
    model_config, cache = config.model_config, config.cache_config
    assert cache.block_size == block_size
    assert cache.mamba_page_size_padded == block_size * token_bytes
    text = model_config.hf_text_config
    state = LayerKind(is_state=True, state=state_shapes_of(text.model_type, text.to_dict()))
    kinds = [state, state, state, FULL_ATTENTION]
    names = [f"model.layers.{i}.{'self_attn' if i == 3 else 'linear_attn'}" for i in range(4)]
    specs = kv_cache_specs(
        names, kinds, block_size=block_size, num_kv_heads=1, head_dim=64,
        dtype=torch.float32, cache_config=cache,
    )  # fmt: skip
    assert {s.page_size_bytes for s in specs.values()} == {block_size * token_bytes}
    cache.kv_cache_layout = KV_CACHE_LAYOUT
    groups = get_kv_cache_groups(config, specs)
    plan = get_kv_cache_config_from_groups(
        config, groups, available_memory=20 * block_size * token_bytes
    )
    layout = KVLayout.from_config(plan, names)
    quant = kv_cache_quant(kv_cache_dtype, len(kinds))
    pool = pool_for(layout, kinds, 1, 64, mx.float32, quant)
    assert pool.nbytes == plan.num_blocks * block_size * token_bytes * pool.layout.num_regions
    # The state page fits the block's K and V rows.
    cache_of = StateLayerCache(pool, 0, kinds[0].state, None, None)
    _, k_rows, v_rows, _ = cache_of._layout()
    assert k_rows == block_size and 0 < v_rows <= block_size


def test_falcon_h1_layers_hold_attention_and_state_memory_as_vllm_plans_them(tiny_falcon_h1_dir):
    """Two memory layers per decoder layer (attention, then its Mamba-2 mixer): vLLM's own hybrid
    grouping takes their specs (the state spec element for element what vLLM's Falcon-H1 class
    computes), puts attention and mixers in two groups and overlays attention layer i and mixer i
    on one region; the pool lays that plan out, a state page within its block's bytes."""
    import torch
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vllm_metal.kv import KV_CACHE_LAYOUT
    from vllm_metal.kv.pool import pool_for
    from vllm_metal.kv.spec import kv_cache_specs
    from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, state_shapes_of

    config = _engine_config(tiny_falcon_h1_dir, enable_prefix_caching=True)
    model_config, cache = config.model_config, config.cache_config
    text = model_config.hf_text_config
    state = LayerKind(is_state=True, state=state_shapes_of(text.model_type, text.to_dict()))
    kinds = [FULL_ATTENTION, state] * 2
    names = [f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn", "mamba")]
    specs = kv_cache_specs(
        names, kinds, block_size=cache.block_size, num_kv_heads=1, head_dim=64,
        dtype=torch.float32, cache_config=cache,
    )  # fmt: skip
    _, theirs = _vllm_state_spec(config)
    ours = specs["model.layers.0.mamba"]
    assert [math.prod(s) for s in theirs.shapes] == [math.prod(s) for s in ours.shapes]
    assert theirs.dtypes == ours.dtypes == (torch.float32, torch.float32)
    assert ours.page_size_bytes == specs["model.layers.0.self_attn"].page_size_bytes == 32 * 512

    cache.kv_cache_layout = KV_CACHE_LAYOUT  # what the engine core resolves before planning
    groups = get_kv_cache_groups(config, specs)
    plan = get_kv_cache_config_from_groups(config, groups, available_memory=40 * 32 * 512)
    members = [(type(g.kv_cache_spec), g.layer_names) for g in plan.kv_cache_groups]
    assert sorted(members, key=lambda m: m[0].__name__) == [
        (FullAttentionSpec, ["model.layers.0.self_attn", "model.layers.1.self_attn"]),
        (MambaSpec, ["model.layers.0.mamba", "model.layers.1.mamba"]),
    ]
    layout = KVLayout.from_config(plan, names)
    assert layout.region_of_layer == (0, 0, 1, 1)
    assert layout.group_of_layer[0::2] != layout.group_of_layer[1::2]
    assert len(set(layout.group_of_layer[0::2])) == len(set(layout.group_of_layer[1::2])) == 1
    pool = pool_for(layout, kinds, 1, 64, mx.float32)
    assert pool.keys[0].shape == (plan.num_blocks, 32, 1, 64)
    assert pool.nbytes == 2 * plan.num_blocks * 32 * 512 <= 40 * 32 * 512


def test_qwen3_5_mtp_drafter_is_inspected_and_refused_by_the_platform(tiny_qwen3_5_dir):
    """vLLM builds the MTP drafter's config from the plugin's class (its own would import
    torchvision), so the refusal is the platform's, naming the flag and the method."""
    with pytest.raises(ValueError) as info:
        _engine_config(
            tiny_qwen3_5_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 1}
        )
    message = str(info.value)
    assert "failed to be inspected" not in message
    for name in ("vllm-metal", "--speculative-config", "'mtp'", "qwen3_5"):
        assert name in message


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["--enable-lora", "qwen3_next"]),
        ({"kv_offloading_size": 1.0}, ["kv_offloading_size=1.0", "qwen3_next"]),
        ({"runner": "pooling"}, ["runner='pooling'", "qwen3_next"]),
        ({"mamba_ssm_cache_dtype": "float16"}, ["--mamba-ssm-cache-dtype float16"]),
        ({"mamba_cache_dtype": "float16"}, ["--mamba-cache-dtype float16"]),
    ],
    ids=["lora", "kv_offload", "pooling", "ssm_dtype", "conv_dtype"],
)
def test_what_the_hybrid_path_lacks_is_refused_by_name(tiny_qwen3_next_dir, kwargs, names):
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_qwen3_next_dir, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message
    for name in names:
        assert name in message


def test_drafting_other_than_ngram_on_a_hybrid_is_refused_naming_ngram(tiny_qwen3_next_dir):
    """The hybrid as its own draft model (vLLM reads that as its MTP method)."""
    spec = {"method": "draft_model", "model": str(tiny_qwen3_next_dir), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_qwen3_next_dir, speculative_config=spec)
    message = str(info.value)
    assert "--speculative-config method=" in message and "use method 'ngram'" in message
    assert "qwen3_next" in message


def test_other_hybrids_are_refused_naming_the_architecture():
    """A Mamba-2 hybrid (Bamba) is checked on the model-config fields the table reads: on
    this host vLLM stops earlier for some of them (their classes import kernels it lacks)."""
    from types import SimpleNamespace

    from vllm_metal.config.kinds import kind_of
    from vllm_metal.config.table import refusal

    model_config = SimpleNamespace(
        model="ibm-ai-platform/Bamba-9B-v1",
        is_hybrid=True,
        hf_config=SimpleNamespace(architectures=["BambaForCausalLM"]),
        hf_text_config=SimpleNamespace(model_type="bamba"),
    )
    config = SimpleNamespace(model_config=model_config)
    assert kind_of(config).name == "hybrid_other"
    assert "model='ibm-ai-platform/Bamba-9B-v1' (bamba, BambaForCausalLM)" in refusal(config, "mlx")


def test_kimi_linear_state_pages_fit_latent_blocks_as_vllm_sizes_them(tiny_kimi_linear_dir):
    """Kimi-Linear's KDA state pages share the latent (MLA) cache's blocks, whose token is one
    latent row (64 + 16 float32 values, 320 bytes) and no values: the page (2 heads x 64 x 64
    float32 + a 3 x 384 window, 37,376 bytes) raises the block to 128 tokens. vLLM's own
    Kimi-Linear class sizes the state as `kv.state.mamba_spec` does, element for element."""
    import torch

    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_kimi_linear_dir, enable_prefix_caching=True)
    model_config, cache = config.model_config, config.cache_config
    assert kind_of(config).name == "latent_state_hybrid"
    assert model_config.use_mla and model_config.is_hybrid
    assert cache.block_size == 128 and cache.mamba_page_size_padded == 128 * 320
    assert cache.mamba_cache_mode == "align" and cache.mamba_block_size == 128
    _, vllm_spec = _vllm_state_spec(config)
    ours = _our_state_spec(config)
    assert [math.prod(s) for s in vllm_spec.shapes] == [math.prod(s) for s in ours.shapes]
    assert vllm_spec.dtypes == ours.dtypes == (torch.float32, torch.float32)
    assert vllm_spec.page_size_bytes == ours.page_size_bytes == 128 * 320

    off = _engine_config(tiny_kimi_linear_dir, enable_prefix_caching=False).cache_config
    assert off.block_size == 128 and off.mamba_cache_mode == "none"


def test_a_kimi_linear_config_without_linear_attn_config_is_refused_by_that_key(tmp_path):
    """transformers 5 alone writes the layer pattern as `layer_types`, which neither vLLM's
    Kimi-Linear config class nor mlx-lm reads."""
    import json

    from tests.fixtures.tiny_kimi_linear import write_tiny_kimi_linear

    model = write_tiny_kimi_linear(tmp_path / "kimi_linear")
    config = json.loads((model / "config.json").read_text())
    for key in ("linear_attn_config", "first_k_dense_replace", "mla_use_nope", "rope_theta"):
        del config[key]  # the keys the fixture adds to what save_pretrained writes
    assert config["layer_types"][:2] == ["linear_attention", "full_attention"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="needs `linear_attn_config`"):
        _engine_config(model)
