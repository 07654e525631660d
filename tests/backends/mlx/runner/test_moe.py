"""Mixture-of-experts models on the paged path: Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert)
through mlx-lm's own sparse blocks (`SwitchGLU`, batched `gather_mm` routing), greedy tokens equal
to transformers float32; an MLX-quantized MoE equal to stock mlx-lm; and the config keys
transformers 5 writes differently from what mlx-lm reads (`vllm_metal.models.hf_config`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.tiny_moe import MOE_ARCHS, tiny_moe_config, write_tiny_moe

NEW_TOKENS = 24
# A mixed batch: single-token, shorter than a block, several blocks, longer than the forced
# prefill chunk (16); the last prompt also fills the prefix cache for the second job.
SHARED_PREFIX = random_prompts(12, [48])[0]
MIXED = random_prompts(11, [1, 5, 17, 40]) + [SHARED_PREFIX + [5]]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(13, [3, 9])]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """Factory `(arch, style="transformers", dtype="float32", top_k=2) -> Path`, cached per
    module."""
    root = tmp_path_factory.mktemp("tiny-moe")
    built = {}

    def make(arch: str, style: str = "transformers", dtype: str = "float32", top_k: int = 2):
        key = (arch, style, dtype, top_k)
        if key not in built:
            built[key] = write_tiny_moe(root / f"{arch}-{style}-{dtype}-top{top_k}", arch,
                                        style=style, dtype=dtype, top_k=top_k)  # fmt: skip
        return built[key]

    return make


# ------------------------------------------------------------------ config keys (no engine)


def _args_class(config):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)[1]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_transformers_5_keys_are_mapped_for_mlx_lm(arch):
    from vllm_metal.models.hf_config import mlx_lm_overrides

    config = tiny_moe_config(arch, style="transformers", rope_theta=12345.0)
    assert "rope_theta" not in config
    overrides = mlx_lm_overrides(config, _args_class(config))
    want = {"rope_theta": 12345.0}
    if arch == "qwen3_moe":  # transformers 5 writes `num_local_experts`, mlx-lm reads `num_experts`
        assert "num_experts" not in config
        want["num_experts"] = 8
    assert overrides == want
    args = _args_class(config).from_dict({**config, **overrides})
    assert args.rope_theta == 12345.0
    assert getattr(args, "num_experts", getattr(args, "num_local_experts", None)) == 8


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hub_style_configs_are_left_alone(arch):
    from vllm_metal.models.hf_config import mlx_lm_overrides

    config = tiny_moe_config(arch, style="hub", rope_theta=12345.0)
    assert mlx_lm_overrides(config, _args_class(config)) == {}
    # A config carrying both forms keeps its own top-level values.
    both = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0},
            "num_local_experts": 3}  # fmt: skip
    assert mlx_lm_overrides(both, _args_class(both)) == {}


def test_dense_and_per_layer_rope_configs_are_left_alone():
    from vllm_metal.models.hf_config import mlx_lm_overrides
    from vllm_metal.testing.tiny_models import tiny_config

    for arch in ("qwen3", "gemma3"):  # top-level rope_theta; Gemma 3's per-layer-type dicts
        config = tiny_config(arch)
        assert mlx_lm_overrides(config, _args_class(config)) == {}, arch
    gemma = {k: v for k, v in tiny_config("gemma3").items() if k != "rope_theta"}
    assert mlx_lm_overrides(gemma, _args_class(gemma)) == {}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiny_moe_loads_and_routes_tokens_apart(moe_model, arch):
    """transformers loads every tensor; its router sends the tokens of one prompt to several
    different expert sets in every layer; our loader's model (transformers 5 config) gives
    transformers' float32 logits."""
    import mlx.core as mx
    import torch
    from transformers import AutoModelForCausalLM

    from tests.fixtures.oracles import hf_logits
    from vllm_metal.models import load_model

    path = moe_model(arch)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    prompt = MIXED[3]
    with torch.no_grad():
        router_logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
    assert len(router_logits) == 2
    for layer, logits in enumerate(router_logits):
        chosen = {tuple(sorted(row.topk(2).indices.tolist())) for row in logits}
        assert len(chosen) >= 2, (layer, chosen)

    adapter = load_model(str(path), compute_dtype=mx.float32)
    ours = np.array(adapter.model(mx.array([prompt]))[0])
    ref = hf_logits(path, prompt)
    assert np.abs(ours - ref).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# ---------------------------------------------------------------------------------- engines


@pytest.mark.slow
@pytest.mark.parametrize(
    # Qwen3-MoE keeps the sparse path in CI's run; the others run in the `full` tier.
    "arch",
    [
        "qwen3_moe",
        pytest.param("mixtral", marks=pytest.mark.full),
        pytest.param("qwen2_moe", marks=pytest.mark.full),
    ],
)
def test_moe_greedy_matches_transformers(moe_model, arch):
    """Chunked prefill (16-token budget) of a mixed batch, then prefix-cache hits: greedy tokens
    equal transformers float32, logprobs within 1e-3. The checkpoints carry transformers 5's
    config keys, so the loader's mapping is on the path."""
    from tests.fixtures.oracles import hf_greedy

    # Mixtral routes each token to 4 of its 8 experts: a full 16-token chunk is then 64 (token,
    # expert) pairs, where mlx-lm's SwitchGLU switches to its sorted path.
    model = moe_model(arch, top_k=4 if arch == "mixtral" else 2)
    engine = {"max_num_batched_tokens": 16, "enable_prefix_caching": True, "max_model_len": 256}
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": PREFIX_HITS, "params": [greedy(NEW_TOKENS)]},
    ]
    mixed, hits = run_engine_job(model, jobs, engine=engine)

    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens(hits) == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    assert_logprobs_match_hf(model, MIXED, mixed)


# Where mlx-lm keeps each family's router and stacked experts.
MOE_BLOCK = {
    "qwen3_moe": "model.layers.0.mlp",
    "mixtral": "model.layers.0.block_sparse_moe",
    "qwen2_moe": "model.layers.0.mlp",
}


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_moe_matches_mlx_lm(moe_model, tmp_path, arch):
    """A 4-bit MLX-quantized MoE (mlx-lm's converter: QuantizedSwitchLinear experts) gives stock
    mlx-lm's greedy tokens."""
    from safetensors import safe_open

    from tests.fixtures.oracles import mlx_lm_greedy
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    src = moe_model(arch, style="hub", dtype="bfloat16")  # mlx_lm.convert reads hub keys
    model = quantize_tiny_model(src, tmp_path / f"{arch}-q4", bits=4, group_size=64)
    config = json.loads((model / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    if arch == "qwen3_moe":  # its predicate keeps the router at 8 bits
        assert config["quantization"]["model.layers.0.mlp.gate"]["bits"] == 8
    with safe_open(str(model / "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert f"{MOE_BLOCK[arch]}.switch_mlp.gate_proj.scales" in names  # stacked, packed experts
    prompts = MIXED[1:4]
    (batch,) = run_engine_job(model, [{"prompts": prompts, "params": [greedy(16)]}])
    assert tokens(batch) == mlx_lm_greedy(model, prompts, 16, dtype="float32")
