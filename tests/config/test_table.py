"""Proves the two-axis capability table: each model kind is detected from a real vLLM config (or,
for shapes vLLM cannot build here, the config fields vLLM derives from a real transformers config),
the table names only kinds and features that exist, and a refusal names the kind, the feature,
the setting that asked for it and what to change."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest


def _model_config(model: Path, **kwargs):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model), max_model_len=256, **kwargs)


def _config(model_config, **parts) -> SimpleNamespace:
    """What the table reads of a VllmConfig, with vLLM's own sub-configs (a real VllmConfig would
    run the platform's checks, which refuse what these tests ask for)."""
    from vllm.config import CacheConfig, ParallelConfig

    fields = {
        "model_config": model_config,
        "parallel_config": ParallelConfig(),
        "cache_config": CacheConfig(),
        "lora_config": None,
        "speculative_config": None,
        "kv_transfer_config": None,
    }
    fields.update(parts)
    return SimpleNamespace(**fields)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from tests.fixtures.tiny_moe import write_tiny_moe

    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe")


@pytest.mark.parametrize(
    ("fixture", "kwargs", "kind"),
    [
        ("qwen3", {}, "text"),
        ("qwen3", {"runner": "pooling"}, "pooling"),
        ("moe_dir", {}, "moe"),
        ("tiny_whisper_dir", {}, "speech_to_text"),
        ("tiny_idefics3_dir", {}, "vision_language"),
        ("tiny_qwen3_next_dir", {}, "state_hybrid"),
        ("tiny_deepseek_v3_dir", {}, "latent_attention"),
        ("tiny_glm4_moe_lite_dir", {}, "latent_attention"),
        ("tiny_deepseek_v2_lite_dir", {}, "latent_attention"),
        ("tiny_minicpm3_dir", {}, "latent_attention"),
        ("tiny_lfm2_dir", {}, "short_conv_hybrid"),
        ("tiny_kimi_linear_dir", {}, "latent_state_hybrid"),
    ],
)
def test_each_served_kind_is_detected_from_vllms_config(
    request, tiny_model_dir, fixture, kwargs, kind
):
    from vllm_metal.config.kinds import kind_of

    model = tiny_model_dir("qwen3") if fixture == "qwen3" else request.getfixturevalue(fixture)
    assert kind_of(_config(_model_config(model, **kwargs))).name == kind


def _fields(hf_config, **flags) -> SimpleNamespace:
    """A model config as vLLM derives it from `hf_config` (the flags vLLM computes from its model
    registry, given here, because vLLM cannot build these models' classes on this host)."""
    model_config = SimpleNamespace(
        model=f"org/{hf_config.model_type}",
        hf_config=hf_config,
        hf_text_config=hf_config.get_text_config(),
        **flags,
    )
    return SimpleNamespace(model_config=model_config)


def test_unserved_shapes_are_their_own_kinds():
    from transformers import BambaConfig, DeepseekV32Config, T5Config
    from vllm.transformers_utils.config import is_encoder_decoder

    from vllm_metal.config.kinds import kind_of

    t5 = T5Config()
    assert kind_of(_fields(t5, is_encoder_decoder=is_encoder_decoder(t5))).name == (
        "encoder_decoder"
    )
    assert kind_of(_fields(DeepseekV32Config(), use_mla=True)).name == "latent_attention_other"
    assert kind_of(_fields(BambaConfig(), is_hybrid=True)).name == "hybrid_other"


def test_the_table_names_only_kinds_and_features_that_exist():
    from vllm_metal.backends import BACKENDS
    from vllm_metal.config import table
    from vllm_metal.config.kinds import BY_NAME
    from vllm_metal.models.families import declarations, model_types
    from vllm_metal.models.layers import STATE_SHAPES

    assert set(table.SUPPORTED) == set(BACKENDS) == set(table.SPECULATIVE_METHODS)
    assert table.check_table() == []
    assert {d.kind for d in declarations().values()} <= set(BY_NAME)
    hybrids = (
        model_types("state_hybrid")
        + model_types("vision_state_hybrid")
        + model_types("short_conv_hybrid")
        + model_types("latent_state_hybrid")
    )
    assert set(hybrids) == set(STATE_SHAPES)
    assert model_types("vision_language") == (
        "gemma3",
        "gemma4",
        "idefics3",
        "qwen2_5_vl",
        "qwen3_vl",
    )
    assert model_types("vision_state_hybrid") == ("qwen3_5", "qwen3_5_moe")


def test_the_check_rejects_a_name_that_is_no_kind_or_feature(monkeypatch):
    from vllm_metal.config import table

    monkeypatch.setitem(table.SUPPORTED, "mlx", {"txet": frozenset({"lora", "loar"})})
    assert table.check_table() == [
        "SUPPORTED['mlx']: 'txet' is no model kind",
        "SUPPORTED['mlx']['txet']: 'loar' is no feature",
    ]


def test_a_refused_feature_names_kind_feature_setting_and_advice(tiny_idefics3_dir):
    from vllm.config import LoRAConfig

    from vllm_metal.config.table import refusal

    model = _model_config(tiny_idefics3_dir)
    message = refusal(_config(model, lora_config=LoRAConfig()), "mlx")
    assert message.startswith("vllm-metal (mlx backend) does not serve LoRA adapters with ")
    assert "vision-language models (gemma3, gemma4, idefics3, qwen2_5_vl, qwen3_vl)" in message
    assert f"--enable-lora with model={str(tiny_idefics3_dir)!r} (idefics3, " in message
    assert message.endswith("; remove --enable-lora")
    assert refusal(_config(model), "mlx") is None


def test_a_kind_a_backend_lacks_is_refused_with_the_kinds_advice(moe_dir):
    from vllm_metal.config.table import refusal

    message = refusal(_config(_model_config(moe_dir)), "mps")
    assert message.startswith("vllm-metal (mps backend) does not serve mixture-of-experts models")
    assert f"model={str(moe_dir)!r} (qwen3_moe, Qwen3MoeForCausalLM)" in message
    assert "use the MLX backend (VLLM_METAL_BACKEND=mlx)" in message
    assert refusal(_config(_model_config(moe_dir)), "mlx") is None


def test_a_parallel_setting_is_refused_on_every_backend(tiny_model_dir):
    from vllm.config import ParallelConfig

    from vllm_metal.config.table import refusal

    config = _config(
        _model_config(tiny_model_dir("qwen3")),
        parallel_config=ParallelConfig(tensor_parallel_size=2),
    )
    for backend in ("mlx", "mps"):
        message = refusal(config, backend)
        assert "tensor parallelism" in message and "tensor_parallel_size=2" in message
        assert "all-reduce" in message and "use --tensor-parallel-size 1" in message


def test_data_parallel_is_served_by_the_mlx_backend_only(tiny_model_dir):
    from vllm.config import ParallelConfig

    from vllm_metal.config.table import refusal

    config = _config(
        _model_config(tiny_model_dir("qwen3")),
        parallel_config=ParallelConfig(data_parallel_size=2),
    )
    assert refusal(config, "mlx") is None
    assert "data_parallel_size=2" in refusal(config, "mps")


def test_pipeline_parallelism_is_refused_for_a_decoder_a_stage_cannot_split(tiny_model_dir):
    from vllm.config import ParallelConfig

    from vllm_metal.config.table import pipeline_refusal, refusal

    def config(arch):
        return _config(
            _model_config(tiny_model_dir(arch)),
            parallel_config=ParallelConfig(pipeline_parallel_size=2),
        )

    assert refusal(config("qwen3"), "mlx") is None
    assert pipeline_refusal(config("qwen3"), "mlx") is None
    message = pipeline_refusal(config("gemma2"), "mlx")
    assert "pipeline parallelism with model_type 'gemma2'" in message
    assert "pipeline_parallel_size=2" in message and "use --pipeline-parallel-size 1" in message
    assert "pipeline_parallel_size=2" in refusal(config("qwen3"), "mps")


@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head"])
@pytest.mark.parametrize(
    ("fixture", "words"),
    [
        ("tiny_deepseek_v3_dir", "multi-head latent attention (MLA) models"),
        ("tiny_kimi_linear_dir", "hybrid models with multi-head latent attention (MLA)"),
        ("tiny_whisper_dir", "speech-to-text models"),
    ],
)
def test_fp8_kv_caches_are_refused_by_name_where_not_built(request, fixture, words, dtype):
    """MLA latent caches (Kimi-Linear's beside its state layers too) and speech models keep
    unquantized caches: an fp8 or per-token-head cache is refused naming the kind and the flag;
    text decoders are served."""
    from vllm.config import CacheConfig

    from vllm_metal.config.table import refusal

    model = _model_config(request.getfixturevalue(fixture))
    message = refusal(_config(model, cache_config=CacheConfig(cache_dtype=dtype)), "mlx")
    assert message is not None
    assert f"quantized KV caches with {words}" in message
    assert f"--kv-cache-dtype {dtype}" in message and "use --kv-cache-dtype auto" in message


@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head"])
@pytest.mark.parametrize(
    ("fixture", "words"),
    [
        ("tiny_qwen3_next_dir", "hybrid models with Gated DeltaNet or Mamba-2 state layers"),
        ("tiny_lfm2_dir", "short-convolution hybrid models"),
    ],
)
def test_hybrids_serve_quantized_attention_pages(request, fixture, words, dtype):
    """A Gated DeltaNet / Mamba-2 / short-convolution hybrid's attention layers take fp8,
    per-token-head pages and TurboQuant slots (its state pages stay float:
    tests/backends/mlx/runner/test_hybrid_quant_kv.py); the torch backend refuses them by name."""
    from vllm.config import CacheConfig

    from vllm_metal.config.table import refusal

    model = _model_config(request.getfixturevalue(fixture))
    assert refusal(_config(model, cache_config=CacheConfig(cache_dtype=dtype)), "mlx") is None
    turbo = CacheConfig(cache_dtype="turboquant_k8v4")
    assert refusal(_config(model, cache_config=turbo), "mlx") is None
    if words.startswith("short-convolution"):
        message = refusal(_config(model, cache_config=turbo), "mps")
        assert "TurboQuant KV caches with " + words in message, message


def test_fp8_kv_caches_are_refused_on_pipeline_stages(tiny_model_dir):
    from vllm.config import CacheConfig, ParallelConfig

    from vllm_metal.config.table import pipeline_refusal

    config = _config(
        _model_config(tiny_model_dir("qwen3")),
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
        cache_config=CacheConfig(cache_dtype="fp8"),
    )
    message = pipeline_refusal(config, "mlx")
    assert "pipeline parallelism with quantized KV caches" in message
    assert "--kv-cache-dtype fp8" in message


@pytest.mark.parametrize("dtype", ["fp8", "int8_per_token_head", "int4_per_token_head"])
def test_vision_language_decoders_serve_quantized_pages(tiny_idefics3_dir, dtype):
    """A vision-language model's decoder takes fp8 and per-token-head pages and TurboQuant slots
    (tests/backends/mlx/runner/test_vision_quant_kv.py; prefix-LM models are refused TurboQuant
    at startup, tests/config/test_startup.py)."""
    from vllm.config import CacheConfig

    from vllm_metal.config.table import refusal

    model = _model_config(tiny_idefics3_dir)
    assert refusal(_config(model, cache_config=CacheConfig(cache_dtype=dtype)), "mlx") is None
    turbo = CacheConfig(cache_dtype="turboquant_k8v4")
    assert refusal(_config(model, cache_config=turbo), "mlx") is None
