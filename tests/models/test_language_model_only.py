"""Proves multimodal checkpoints whose towers the runner does not run are served as text models.

vLLM 0.32 cannot build its config for Mistral 3, Gemma 3 or the Qwen-VL families on Linux (the
architecture check imports torchvision, which does not load beside torch 2.13.0+cpu), so the
platform's decision is checked on the model-config fields it reads, and the loading on a tiny
random Mistral 3 checkpoint written by transformers: its language model, loaded through mlx-lm's
`mistral3` module, gives transformers' float32 logits.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_metal.config.kinds import kind_of


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory):
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    text = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    vision = PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        image_size=64,
        patch_size=16,
    )
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=10, tie_word_embeddings=False
    )
    out = tmp_path_factory.mktemp("mistral3") / "tiny"
    Mistral3ForConditionalGeneration(config).save_pretrained(out)
    return out


def _config(model_type: str, language_model_only: bool = False) -> SimpleNamespace:
    model_config = SimpleNamespace(
        model=f"org/{model_type}",
        is_multimodal_model=True,
        is_encoder_decoder=False,
        multimodal_config=SimpleNamespace(language_model_only=language_model_only),
        hf_config=SimpleNamespace(model_type=model_type, architectures=[f"{model_type}-arch"]),
    )
    return SimpleNamespace(model_config=model_config)


def _refused_as_multimodal(config) -> bool:
    return kind_of(config).name == "multimodal"


@pytest.mark.parametrize("model_type", ["mistral3", "qwen2_vl", "pixtral"])
def test_a_tower_the_runner_lacks_is_served_text_only(model_type) -> None:
    from vllm_metal.config.multimodal import serve_language_model_only

    config = _config(model_type)
    assert serve_language_model_only(config)
    assert config.model_config.multimodal_config.language_model_only
    assert not _refused_as_multimodal(config)


def test_without_an_mlx_lm_text_model_the_checkpoint_is_refused() -> None:
    from vllm_metal.config.multimodal import serve_language_model_only

    config = _config("idefics2")
    assert not serve_language_model_only(config)
    assert _refused_as_multimodal(config)


@pytest.mark.parametrize("model_type", ["gemma3", "idefics3", "qwen2_5_vl", "qwen3_vl"])
def test_a_family_whose_towers_run_keeps_its_images(model_type) -> None:
    from vllm_metal.config.multimodal import serve_language_model_only

    config = _config(model_type)
    assert not serve_language_model_only(config)
    assert not config.model_config.multimodal_config.language_model_only


def test_the_language_model_of_a_mistral3_checkpoint_matches_transformers(mistral3_dir) -> None:
    import mlx.core as mx
    import torch
    from transformers import Mistral3ForConditionalGeneration

    from vllm_metal.models import load_model

    config = json.loads((mistral3_dir / "config.json").read_text())
    adapter = load_model(str(mistral3_dir), compute_dtype=mx.float32, hf_config=config)
    assert adapter.model_type == "mistral"  # the text config's family adapter
    assert adapter.attention_layer_names == [f"model.layers.{i}.self_attn" for i in range(2)]
    prompt = [1, 5, 17, 300, 42, 9, 400, 77]
    ours = np.array(adapter.model(mx.array([prompt])))[0]
    hf = Mistral3ForConditionalGeneration.from_pretrained(mistral3_dir, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.eval()(input_ids=torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("prefix_lm", "language_model_only", "kept_whole"),
    [(True, False, True), (False, False, False), (True, True, False)],
    ids=["prefix-lm", "causal-lm", "prefix-lm-text-only"],
)
def test_a_prefix_lm_keeps_each_image_in_one_step(prefix_lm, language_model_only, kept_whole):
    """Gemma 3's image tokens attend to each other both ways: the scheduler must not cut an image
    across steps (`disable_chunked_mm_input`) unless images are not taken at all."""
    from vllm_metal.config.multimodal import keep_media_spans_whole

    config = _config("gemma3", language_model_only)
    config.model_config.is_mm_prefix_lm = prefix_lm
    config.scheduler_config = SimpleNamespace(disable_chunked_mm_input=False)
    keep_media_spans_whole(config)
    assert config.scheduler_config.disable_chunked_mm_input is kept_whole


def test_vllm_counts_gemma3_as_a_prefix_lm() -> None:
    """What `keep_media_spans_whole` reads: vLLM's own verdict on a Gemma 3 config."""
    from transformers import Gemma3Config
    from vllm.config import ModelConfig  # noqa: F401 (loads the convertor module in vLLM's order)
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    config = Gemma3Config()
    convertor = ModelArchConfigConvertorBase(config, config.get_text_config())
    assert convertor.is_mm_prefix_lm()
    assert not convertor.is_mm_prefix_lm(supports_multimodal=False)


def _qwen3_5_config(model_type: str) -> SimpleNamespace:
    """What the platform reads of a Qwen3.5 wrapper's vLLM config (a hybrid, multimodal)."""
    config = _config(model_type)
    config.model_config.is_hybrid = True
    config.model_config.hf_text_config = SimpleNamespace(model_type=f"{model_type}_text")
    return config


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("towers_run", [False, True], ids=["no-vllm-processor", "vllm-processor"])
def test_qwen3_5_is_served_with_its_towers_only_where_vllms_processor_imports(
    monkeypatch, model_type, towers_run
) -> None:
    """Where vLLM's Qwen3.5 processor does not import (this Linux host) the wrapper is a state
    hybrid served text-only; where it does, a vision-language state hybrid keeping its media."""
    from vllm_metal.compat import vllm_models
    from vllm_metal.config.multimodal import serve_language_model_only
    from vllm_metal.models import loads_towers

    if sys.platform == "linux":
        assert not vllm_models.uses_vllm_processor(
            "qwen3_5"
        )  # no torchvision beside torch 2.13.0+cpu
    monkeypatch.setattr(vllm_models, "uses_vllm_processor", lambda module: towers_run)
    config = _qwen3_5_config(model_type)
    assert serve_language_model_only(config) is not towers_run
    assert config.model_config.multimodal_config.language_model_only is not towers_run
    assert kind_of(config).name == ("vision_state_hybrid" if towers_run else "state_hybrid")
    assert loads_towers(config.model_config.model, model_type) is towers_run
    assert not loads_towers(config.model_config.model, model_type, language_model_only=True)
