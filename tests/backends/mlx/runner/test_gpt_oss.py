"""GPT-OSS on the paged path: attention sinks reach the paged op, alternate layers keep a sliding
window (32 in the tiny model, so prompts outrun it), the MoE runs mlx-lm's batched experts, dense
and MXFP4 checkpoints load, and the engine's greedy tokens equal transformers float32.

The unit tests run the MLX model in-process (no engine); the engine test is marked `slow` (one
engine job on the MXFP4 checkpoint; the dense layout's in the `full` tier).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.oracles import hf_greedy, hf_logits, load_hf_model
from tests.fixtures.tiny_gpt_oss import (
    mxfp4_dequantize,
    tiny_gpt_oss_config,
    write_tiny_gpt_oss,
)

WINDOW = 32
NEW_TOKENS = 32
# Mixed lengths in one batch: single token, shorter than a block, several blocks, longer than the
# window and than the forced prefill chunk (16).
MIXED = random_prompts(1, [1, 5, 17, 40, 75])
SHARED_PREFIX = random_prompts(2, [48])[0]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(3, [3, 9])]
PROMPT = [5, 17, 301, 42, 9, 600, 77, 88, 99, 123, 444, 555] + list(range(100, 140))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return write_tiny_gpt_oss(tmp_path_factory.mktemp("gpt-oss") / "dense", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    return write_tiny_gpt_oss(
        tmp_path_factory.mktemp("gpt-oss") / "mxfp4", sliding_window=WINDOW, mxfp4=True
    )


def _load(path, **kwargs):
    import mlx.core as mx

    from vllm_metal.models import load_model

    return load_model(str(path), compute_dtype=mx.float32, **kwargs)


def _logits(adapter, token_ids) -> np.ndarray:
    """Plain mlx-lm forward (its own causal and window masks, no paged cache)."""
    import mlx.core as mx

    return np.array(adapter.model(mx.array([list(token_ids)])))[0]


def _hf_float32(path):
    # transformers keeps dequantized MXFP4 experts in bfloat16 whatever the requested dtype;
    # every MXFP4 value is exact in float32, so casting gives the float32 reference.
    return load_hf_model(path).float()


# --------------------------------------------------------------------------- unit tests (no engine)


def test_layer_kinds_give_vllm_sliding_window_specs(gpt_oss_dir):
    import torch

    from vllm_metal.kv.spec import kv_cache_specs

    adapter = _load(gpt_oss_dir)
    layer_types = tiny_gpt_oss_config()["layer_types"]
    assert [k.label for k in adapter.layer_kinds()] == [
        f"sliding({WINDOW})" if t == "sliding_attention" else "full" for t in layer_types
    ]
    specs = kv_cache_specs(
        adapter.attention_layer_names,
        adapter.layer_kinds(),
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32,
    )
    windows = [getattr(s, "sliding_window", None) for s in specs.values()]
    assert windows == [WINDOW, None, WINDOW, None]
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(4)]


def test_dense_checkpoint_matches_transformers(gpt_oss_dir):
    """Dense experts load (mlx-lm alone refuses them) and the model equals transformers float32,
    past the window; mlx-lm's own YaRN (correction range always rounded) would not."""
    from mlx_lm.models.rope_utils import initialize_rope

    adapter = _load(gpt_oss_dir)
    assert len(PROMPT) > WINDOW
    ref = hf_logits(gpt_oss_dir, PROMPT)
    np.testing.assert_allclose(_logits(adapter, PROMPT), ref, atol=2e-3, rtol=0)

    config = adapter.config
    for layer in adapter.model.layers:
        layer.self_attn.rope = initialize_rope(
            64, config["rope_theta"], False, scaling_config=config["rope_scaling"]
        )
    assert np.abs(_logits(adapter, PROMPT) - ref).max() > 0.1


def test_a_transformers_5_config_gets_its_yarn(gpt_oss_dir, tmp_path):
    """transformers 5 saves RoPE settings only in `rope_parameters`; mlx-lm reads `rope_scaling`
    and `rope_theta` and would run a plain RoPE of the wrong base."""
    import json
    import shutil

    shutil.copytree(gpt_oss_dir, tmp_path / "t5")
    config_path = tmp_path / "t5" / "config.json"
    config = json.loads(config_path.read_text())
    del config["rope_scaling"], config["rope_theta"]
    config_path.write_text(json.dumps(config))
    adapter = _load(tmp_path / "t5")
    ref = hf_logits(gpt_oss_dir, PROMPT)  # the original config: same model for transformers
    np.testing.assert_allclose(_logits(adapter, PROMPT), ref, atol=2e-3, rtol=0)


def test_zeroing_the_sinks_changes_the_output(gpt_oss_dir):
    import mlx.core as mx

    adapter = _load(gpt_oss_dir)
    sinks = [layer.self_attn.sinks for layer in adapter.model.layers]
    assert all(float(mx.abs(s).min()) > 0 and float(mx.std(s)) > 0.3 for s in sinks)
    with_sinks = _logits(adapter, PROMPT)
    for layer in adapter.model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    without = _logits(adapter, PROMPT)
    assert np.abs(with_sinks - without).max() > 1.0
    # Most next-token choices change.
    assert (with_sinks.argmax(-1) != without.argmax(-1)).mean() > 0.5


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_transformers(truncate):
    import mlx.core as mx
    from mlx_lm.models.rope_utils import YarnRoPE
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.fixtures.tiny_gpt_oss import ROPE_SCALING, ROPE_THETA
    from vllm_metal.models.families.gpt_oss import yarn_frequencies

    scaling = {**ROPE_SCALING, "truncate": truncate}
    hf = GptOssConfig(head_dim=64, rope_parameters={**scaling, "rope_theta": ROPE_THETA})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    ours = np.array(yarn_frequencies(64, ROPE_THETA, scaling))
    np.testing.assert_allclose(1.0 / ours, inv_freq.numpy(), rtol=1e-5)
    mlx_lm_rope = YarnRoPE(
        64,
        base=ROPE_THETA,
        scaling_factor=scaling["factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
        beta_fast=scaling["beta_fast"],
        beta_slow=scaling["beta_slow"],
    )
    # mlx-lm agrees only where transformers rounds too.
    same = np.allclose(np.array(mlx_lm_rope._freqs), ours, rtol=1e-5)
    assert same == truncate, mx.abs(mlx_lm_rope._freqs - mx.array(ours)).max()


def test_sanitize_unfuses_transformers_experts():
    import mlx.core as mx

    from vllm_metal.models.families.gpt_oss import sanitize

    experts, hidden, inter = 2, 3, 4
    p = "model.layers.0.mlp.experts."
    gate_up = np.arange(experts * hidden * 2 * inter, dtype=np.float32).reshape(
        experts, hidden, 2 * inter
    )
    down = np.arange(experts * inter * hidden, dtype=np.float32).reshape(experts, inter, hidden)
    weights = {
        p + "gate_up_proj": mx.array(gate_up),
        p + "gate_up_proj_bias": mx.array(gate_up[:, 0, :]),
        p + "down_proj": mx.array(down),
        p + "down_proj_bias": mx.array(down[:, 0, :]),
        "model.layers.0.mlp.router.weight": mx.zeros((experts, hidden)),
    }
    out = {k: np.array(v) for k, v in sanitize(weights).items()}
    assert sorted(out) == sorted(
        [p + f"{m}.{w}" for m in ("gate_proj", "up_proj", "down_proj") for w in ("weight", "bias")]
        + ["model.layers.0.mlp.router.weight"]
    )
    # Gate and up are interleaved along transformers' output axis; mlx-lm keeps [E, out, in].
    np.testing.assert_array_equal(out[p + "gate_proj.weight"], gate_up[..., ::2].swapaxes(1, 2))
    np.testing.assert_array_equal(out[p + "up_proj.weight"], gate_up[..., 1::2].swapaxes(1, 2))
    np.testing.assert_array_equal(out[p + "gate_proj.bias"], gate_up[:, 0, ::2])
    np.testing.assert_array_equal(out[p + "up_proj.bias"], gate_up[:, 0, 1::2])
    np.testing.assert_array_equal(out[p + "down_proj.weight"], down.swapaxes(1, 2))
    # A published (MXFP4) or mlx-lm layout is left to mlx-lm's own sanitize.
    other = {p + "gate_up_proj_blocks": mx.zeros((1,))}
    assert sanitize(other) is other


def test_mxfp4_layout_is_the_published_one(mxfp4_dir):
    import torch
    from safetensors.numpy import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(mxfp4_dir / "model.safetensors"))
    blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]
    assert blocks.shape == (4, 256, 2, 16) and blocks.dtype == np.uint8  # [E, 2 * inter, G, 16]
    assert scales.shape == (4, 256, 2) and scales.dtype == np.uint8
    ref = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    np.testing.assert_array_equal(mxfp4_dequantize(blocks, scales), ref.numpy())


@pytest.mark.parametrize("dequantize", [False, True], ids=["mxfp4", "dense"])
def test_mxfp4_checkpoint_matches_transformers(mxfp4_dir, dequantize):
    """mlx-lm reads the published MXFP4 blocks (kept quantized, or dequantized for the CPU's
    BLAS); both equal transformers' dequantized model in float32."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    adapter = _load(mxfp4_dir, dequantize=dequantize)
    experts = adapter.model.layers[0].mlp.experts
    if dequantize:
        assert type(experts.gate_proj) is SwitchLinear
    else:
        assert isinstance(experts.gate_proj, QuantizedSwitchLinear)
        assert experts.gate_proj.mode == "mxfp4"
    _hf_float32(mxfp4_dir)
    ref = hf_logits(mxfp4_dir, PROMPT)
    np.testing.assert_allclose(_logits(adapter, PROMPT), ref, atol=2e-3, rtol=0)


def test_vllm_accepts_the_mxfp4_checkpoint_in_float32(mxfp4_dir):
    """vLLM names the checkpoint's MXFP4 `gpt_oss_mxfp4` and allows it only in bfloat16; on this
    platform it is a format the loader reads, in every dtype, and not a vLLM method to refuse."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

    assert GptOssMxfp4Config.get_supported_act_dtypes() == [torch.bfloat16]  # vLLM's own rule
    own = vars(GptOssMxfp4Config).get("get_supported_act_dtypes")
    try:
        config = EngineArgs(
            model=str(mxfp4_dir), max_model_len=256, dtype="float32"
        ).create_engine_config()
    finally:  # the platform widened the class for the rest of the process: put vLLM's back
        if own is None:
            if "get_supported_act_dtypes" in vars(GptOssMxfp4Config):
                delattr(GptOssMxfp4Config, "get_supported_act_dtypes")
        else:
            GptOssMxfp4Config.get_supported_act_dtypes = own
    assert config.model_config.quantization == "gpt_oss_mxfp4"
    assert config.model_config.dtype == torch.float32
    # Other vLLM methods are still refused (test_platform covers the message).
    from vllm_metal.config.features import BY_NAME

    row = BY_NAME["vllm_quantization"]
    assert not row.requested(config)
    object.__setattr__(config.model_config, "quantization", "awq")
    assert row.requested(config) == "quantization='awq'"


# --------------------------------------------------------------------------------- engine tests


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["mxfp4", pytest.param("dense", marks=pytest.mark.full)])
def test_engine_greedy_and_logprobs_match_transformers(request, checkpoint):
    """One engine: a mixed batch longer than the window in 16-token chunks, then prefix-cache hits;
    greedy tokens identical to transformers float32, logprobs within 1e-3. CI runs the published
    MXFP4 layout (transformers' dequantized model, cast to float32, is the reference); the bf16
    expert layout runs in the `full` tier."""
    model = request.getfixturevalue(f"{'mxfp4' if checkpoint == 'mxfp4' else 'gpt_oss'}_dir")
    if checkpoint == "mxfp4":
        _hf_float32(model)
    engine = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": [SHARED_PREFIX + [5]], "params": [greedy(4)]},
        {"prompts": PREFIX_HITS, "params": [greedy(NEW_TOKENS)]},
    ]
    mixed, _, hits = run_engine_job(model, jobs, engine=engine)

    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens(hits) == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    # Continuations are varied, so the comparison means something.
    assert all(len(set(t)) > NEW_TOKENS // 2 for t in tokens(mixed))
    assert_logprobs_match_hf(model, MIXED, mixed)
