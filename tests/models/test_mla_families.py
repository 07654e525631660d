"""DeepSeek-V2 and MiniCPM3 as the MLX runner loads them: vLLM 0.32 builds each tiny checkpoint's
config, and the KV specs it is given are MLA latent specs of one head as wide as the latent plus
the rotary key (MiniCPM3 too, which vLLM's config sizes as plain attention); mlx-lm's
`kv_b_proj` is split at load into per-head key and value parts whose absorbed products equal the
expanded ones, for a bf16/fp32 checkpoint and for an MLX-quantized one (dequantized)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

ROW = 64 + 16  # kv_lora_rank + qk_rope_head_dim of every tiny checkpoint here
FIXTURES = ("tiny_deepseek_v2_lite_dir", "tiny_deepseek_v2_grouped_dir", "tiny_minicpm3_dir")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_vllm_builds_the_config_and_sees_latent_specs(request, fixture):
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vllm_metal.kv.spec import kv_cache_specs
    from vllm_metal.models import load_model

    model = request.getfixturevalue(fixture)
    model_config = ModelConfig(model=str(model), max_model_len=256)
    architecture = model_config.hf_config.architectures[0]
    assert model_config.registry.is_text_generation_model([architecture], model_config)
    adapter = load_model(str(model), compute_dtype=mx.float32)
    specs = kv_cache_specs(
        adapter.attention_layer_names,
        adapter.layer_kinds(),
        block_size=16,
        num_kv_heads=model_config.get_num_kv_heads(ParallelConfig()),
        head_dim=model_config.get_head_size(),
        dtype=torch.float32,
    )
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(3)]
    for spec in specs.values():
        assert isinstance(spec, MLAAttentionSpec)
        assert (spec.num_kv_heads, spec.head_size) == (1, ROW)
        assert spec.page_size_bytes == 16 * ROW * 4


def _absorbed_equals_expanded(attn, kv_b_weight: mx.array) -> None:
    """Scores and values through the split parts equal those through the whole projection."""
    heads, nope, v = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    rng = np.random.default_rng(0)
    q_nope = mx.array(rng.standard_normal((3, heads, 1, nope)).astype(np.float32))
    latent = mx.array(rng.standard_normal((5, attn.kv_lora_rank)).astype(np.float32))
    expanded = (latent @ kv_b_weight.astype(mx.float32).T).reshape(5, heads, nope + v)
    keys, values = expanded[..., :nope], expanded[..., nope:]  # [5, H, nope], [5, H, v]
    scores = mx.einsum("thd,shd->ths", q_nope[:, :, 0], keys)
    absorbed = attn.embed_q(q_nope)[:, :, 0] @ latent.T  # [3, H, 5]
    np.testing.assert_allclose(np.array(absorbed), np.array(scores), rtol=1e-4, atol=1e-4)
    mix = mx.array(rng.standard_normal((3, heads, 5)).astype(np.float32))
    out = attn.unembed_out((mix @ latent)[:, :, None, :])[:, :, 0]  # [3, H, v]
    expected = mx.einsum("ths,shd->thd", mix, values)
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fixture", ("tiny_deepseek_v2_lite_dir", "tiny_minicpm3_dir"))
def test_kv_b_proj_is_split_per_head(request, fixture):
    from vllm_metal.models import load_model

    model = request.getfixturevalue(fixture)
    weights = mx.load(str(Path(model) / "model.safetensors"))
    adapter = load_model(str(model), compute_dtype=mx.float32)
    for i, layer in enumerate(adapter.model.layers):
        attn = layer.self_attn
        assert "kv_b_proj" not in attn
        _absorbed_equals_expanded(attn, weights[f"model.layers.{i}.self_attn.kv_b_proj.weight"])


def test_a_quantized_kv_b_proj_is_dequantized_at_load(tiny_deepseek_v2_lite_dir, tmp_path):
    from vllm_metal.models import load_model
    from vllm_metal.models.hf_config import checkpoint_overrides
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    # mlx-lm's converter reads the config as the hub's checkpoints write it (a top-level
    # `rope_scaling`, where transformers 5 keeps only `rope_parameters`).
    src = Path(shutil.copytree(tiny_deepseek_v2_lite_dir, tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **checkpoint_overrides(src)}))
    model = quantize_tiny_model(src, tmp_path / "q4", bits=4, group_size=64)
    weights = {}
    for path in model.glob("*.safetensors"):
        weights.update(mx.load(str(path)))
    adapter = load_model(str(model), compute_dtype=mx.float32, dequantize=False)
    for i, layer in enumerate(adapter.model.layers):
        prefix = f"model.layers.{i}.self_attn.kv_b_proj"
        assert f"{prefix}.scales" in weights  # the checkpoint's kv_b_proj is quantized
        dense = mx.dequantize(
            weights[f"{prefix}.weight"],
            weights[f"{prefix}.scales"],
            weights[f"{prefix}.biases"],
            group_size=64,
            bits=4,
        )
        _absorbed_equals_expanded(layer.self_attn, dense)


@pytest.mark.parametrize("tied", [True, False])
def test_minicpm3_logits_scale_the_hidden_states_before_either_head(tmp_path, tied):
    """transformers divides by `hidden_size / dim_model_base` before a tied head too (mlx-lm's
    class only before an untied one)."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.tiny_minicpm3 import write_tiny_minicpm3
    from vllm_metal.models import load_model

    model = write_tiny_minicpm3(tmp_path / "minicpm3", tie_word_embeddings=tied)
    adapter = load_model(str(model), compute_dtype=mx.float32)
    hidden = np.random.default_rng(1).standard_normal((3, 1, 128)).astype(np.float32)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.lm_head(torch.from_numpy(hidden) / hf.config.logits_scaling).numpy()
    logits = np.array(adapter.logits(mx.array(hidden)))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_minicpm3_rotates_by_the_short_factors_within_the_original_length(tmp_path):
    """Where LongRoPE's short and long factors differ, positions below
    `original_max_position_embeddings` rotate as transformers' rotary embedding does (mlx-lm's
    class takes the long factors everywhere)."""
    from transformers import AutoConfig
    from transformers.models.minicpm3.modeling_minicpm3 import (
        MiniCPM3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from tests.fixtures.tiny_minicpm3 import write_tiny_minicpm3
    from vllm_metal.models import load_model

    short = [1.0, 1.0, 1.0, 1.1, 1.1, 1.2, 1.3, 1.4]
    model = write_tiny_minicpm3(tmp_path / "minicpm3", short_factor=short)
    adapter = load_model(str(model), compute_dtype=mx.float32)
    rope = adapter.model.layers[0].self_attn.rope
    positions = np.array([0, 1, 7, 300, 1500, 2047])
    x = np.random.default_rng(2).standard_normal((len(positions), 4, 1, 16)).astype(np.float32)
    rotated = np.array(rope(mx.array(x), mx.array(positions.astype(np.int32))))

    config = AutoConfig.from_pretrained(model)
    cos, sin = MiniCPM3RotaryEmbedding(config)(torch.zeros(1), torch.from_numpy(positions)[None])
    q = torch.from_numpy(x[:, :, 0]).permute(1, 0, 2)[None]  # [1, H, T, D]
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    expected = expected[0].permute(1, 0, 2).numpy()  # [T, H, D]
    np.testing.assert_allclose(rotated[:, :, 0], expected, rtol=1e-4, atol=1e-4)
    long = np.array(rope.long(mx.array(x), mx.array(positions.astype(np.int32))))
    assert not np.allclose(long[:, :, 0], expected, atol=1e-3)  # the factors matter here
