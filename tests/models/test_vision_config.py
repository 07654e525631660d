"""Proves the startup checks for vision-language models, without an engine: vLLM builds its config
for the tiny random Idefics3 and the plugin accepts it as a model the MLX runner serves with
images; what that runner does not run beside it (LoRA, speculative decoding, KV offloading, image
embeddings as input) is refused while vLLM builds its config, naming the setting and the model
type; a limit for a modality the model does not have is left to vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model), max_model_len=512, dtype="float32", **kwargs
    ).create_engine_config()


def test_idefics3_is_accepted_as_a_vision_language_model(tiny_idefics3_dir) -> None:
    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_idefics3_dir, limit_mm_per_prompt={"image": 2})
    # vLLM's own view of the checkpoint, before the plugin names it.
    assert config.model_config.is_multimodal_model
    assert not config.model_config.is_encoder_decoder
    assert config.model_config.multimodal_config.get_limit_per_prompt("image") == 2
    assert kind_of(config).name == "vision_language"


def test_a_text_model_is_not_named_a_vision_language_model(tiny_model_dir) -> None:
    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_model_dir("qwen3"))
    assert not config.model_config.is_multimodal_model
    assert kind_of(config).name == "text"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["--enable-lora", "idefics3"]),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            ["--speculative-config", "idefics3"],
        ),
        ({"kv_offloading_size": 1.0}, ["kv_offloading_size=1.0", "idefics3"]),
        ({"enable_mm_embeds": True}, ["--enable-mm-embeds", "idefics3"]),
    ],
    ids=["lora", "speculative", "kv_offload", "mm_embeds"],
)
def test_what_the_vision_runner_lacks_is_refused_by_name(tiny_idefics3_dir, kwargs, names) -> None:
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_idefics3_dir, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message
    assert "vision-language" in message
    for name in names:
        assert name in message


def test_modalities_the_family_does_not_declare_get_a_limit_of_zero(tiny_idefics3_dir) -> None:
    """vLLM's front end then answers a video with a 400. Asking for videos is accepted as vLLM
    accepts it: vLLM's Idefics3 has no video input, so its own front end refuses them."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    config = _engine_config(tiny_idefics3_dir)
    mm = config.model_config.multimodal_config
    assert mm.get_limit_per_prompt("video") == 0
    assert mm.get_limit_per_prompt("audio") == 0
    assert mm.get_limit_per_prompt("image") > 0
    asked = _engine_config(tiny_idefics3_dir, limit_mm_per_prompt={"image": 2, "video": 1})
    assert asked.model_config.multimodal_config.get_limit_per_prompt("video") == 1
    info = MULTIMODAL_REGISTRY.create_processor(config.model_config).info
    assert set(info.get_supported_mm_limits()) == {"image"}


def test_video_token_pruning_is_refused_by_name(tiny_idefics3_dir) -> None:
    """Pruned videos have fewer placeholder tokens than their grids; the runner places them all."""
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_idefics3_dir, video_pruning_rate=0.5)
    assert "--video-pruning-rate 0.5" in str(info.value)
    assert "idefics3" in str(info.value)
