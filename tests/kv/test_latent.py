"""Latent (MLA) caches: one row per token and layer, sized exactly as vLLM's `MLAAttentionSpec`
counts it (no values); a layer's cache view writes rows at their slots only and attends over
them; what the MLA path does not run is refused by name at startup."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.kv.spec import kv_cache_specs
from vllm_metal.models.layers import LATENT

WIDTH = 48  # latent 32 + rotary 16
VALUE_DIM = 32


def test_pool_bytes_equal_vllms_page_count():
    specs = kv_cache_specs(
        ["l0", "l1", "l2"],
        [LATENT] * 3,
        block_size=16,
        num_kv_heads=1,
        head_dim=WIDTH,
        dtype=torch.float16,
    )
    assert all(isinstance(s, MLAAttentionSpec) for s in specs.values())
    pool = KVPool(KVLayout.single_group(3, 10, 16), 1, WIDTH, mx.float16, latent=True)
    assert pool.values == [] and pool.keys[0].shape == (10, 16, WIDTH)
    assert pool.nbytes == 10 * sum(s.page_size_bytes for s in specs.values()) == 10 * 3 * 16 * 96


def _step(seq_lens: list[int], q_lens: list[int], blocks: list[list[int]], slots: list[int]):
    positions = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    meta = StepMetadata(
        positions=mx.array(positions.astype(np.int32)),
        seq_lens=mx.array(np.array(seq_lens, dtype=np.int32)),
        cu_seqlens_q=mx.array(np.cumsum([0, *q_lens]).astype(np.int32)),
        groups=[],
    )
    tables = GroupTables(
        block_tables=mx.array(np.array(blocks, dtype=np.int32)),
        slot_mapping=mx.array(np.array(slots, dtype=np.int64)),
    )
    return meta, tables


def test_rows_land_at_their_slots_and_attention_mixes_the_latent_part():
    pool = KVPool(KVLayout.single_group(1, 4, 16), 1, WIDTH, mx.float32, latent=True)
    rng = np.random.default_rng(0)
    # One sequence of 20 tokens in blocks 2 then 0, written as one prefill step; a padding row.
    rows = rng.standard_normal((21, WIDTH)).astype(np.float32)
    slots = [2 * 16 + i for i in range(16)] + [i for i in range(4)] + [-1]
    meta, tables = _step([20], [20], [[2, 0]], slots)  # rows are written by slot alone
    cache = LatentLayerCache(pool, 0, meta, tables)
    before = np.array(pool.keys[0])
    cache.write(mx.array(rows))
    after = np.array(pool.keys[0])
    np.testing.assert_array_equal(after[2], rows[:16])
    np.testing.assert_array_equal(after[0, :4], rows[16:20])
    np.testing.assert_array_equal(after[0, 4:], before[0, 4:])
    np.testing.assert_array_equal(after[[1, 3]], before[[1, 3]])

    # Decode of the last token: 3 heads over all 20 rows.
    query = rng.standard_normal((1, 3, WIDTH)).astype(np.float32)
    meta, tables = _step([20], [1], [[2, 0]], [3])
    out = np.array(LatentLayerCache(pool, 0, meta, tables).attend(mx.array(query), 0.2, VALUE_DIM))
    logits = 0.2 * query[0] @ rows[:20].T  # [3, 20]
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(out[0], weights @ rows[:20, :VALUE_DIM], rtol=1e-5, atol=1e-5)


def test_a_latent_cache_needs_a_latent_pool():
    pool = KVPool(KVLayout.single_group(1, 2, 16), 1, WIDTH, mx.float32)
    meta, tables = _step([1], [1], [[0]], [0])
    with pytest.raises(ValueError, match="latent"):
        LatentLayerCache(pool, 0, meta, tables)


# ----------------------------------------------------------------- startup (vLLM's config)


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = {"max_model_len": 256, "dtype": "float32", **kwargs}
    return EngineArgs(model=str(model), **args).create_engine_config()


def test_deepseek_v3_is_served_as_mla(tiny_deepseek_v3_dir):
    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_deepseek_v3_dir)
    model = config.model_config
    assert model.use_mla and model.get_head_size() == 64 + 16
    assert kind_of(config).name == "latent_attention"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["--enable-lora", "deepseek_v3"]),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            ["--speculative-config", "deepseek_v3"],
        ),
        ({"kv_offloading_size": 1.0}, ["kv_offloading_size=1.0", "deepseek_v3"]),
    ],
    ids=["lora", "speculative", "kv_offload"],
)
def test_what_the_mla_path_lacks_is_refused_by_name(tiny_deepseek_v3_dir, kwargs, names):
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_deepseek_v3_dir, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message and "MLA" in message
    for name in names:
        assert name in message


def test_other_mla_models_are_refused_naming_the_architecture():
    """DeepSeek-V3.2 is MLA too, but its sparse attention is not implemented; the row reads only
    the model-config fields below."""
    from vllm_metal.config.kinds import kind_of
    from vllm_metal.config.table import refusal

    model_config = SimpleNamespace(
        model="deepseek-ai/DeepSeek-V3.2",
        use_mla=True,
        hf_config=SimpleNamespace(architectures=["DeepseekV32ForCausalLM"]),
        hf_text_config=SimpleNamespace(model_type="deepseek_v32"),
    )
    config = SimpleNamespace(model_config=model_config)
    assert kind_of(config).name == "latent_attention_other"
    assert "model='deepseek-ai/DeepSeek-V3.2' (deepseek_v32, DeepseekV32ForCausalLM)" in (
        refusal(config, "mlx")
    )
