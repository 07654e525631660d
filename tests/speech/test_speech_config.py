"""Startup checks for speech models: Whisper is served by the MLX backend's speech runner,
Qwen3-ASR as an audio-language decoder; what either is not served with is refused while vLLM
builds its config, naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), **{"max_model_len": 448, **kwargs}).create_engine_config()


def test_whisper_is_accepted_as_a_transcription_model(tiny_whisper_dir) -> None:
    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_whisper_dir)
    assert config.model_config.is_encoder_decoder
    assert kind_of(config).name == "speech_to_text"
    # vLLM's scheduler: no chunked prefill, the encoder budget holds a whole clip.
    assert config.scheduler_config.max_num_encoder_input_tokens >= 1500


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["--enable-lora", "whisper"]),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            ["--speculative-config", "whisper"],
        ),
        ({"kv_offloading_size": 1.0}, ["kv_offloading_size=1.0", "whisper"]),
    ],
    ids=["lora", "speculative", "kv_offload"],
)
def test_what_the_speech_runner_lacks_is_refused_by_name(tiny_whisper_dir, kwargs, names) -> None:
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_whisper_dir, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message
    for name in names:
        assert name in message


def test_qwen3_asr_is_an_audio_language_model(tiny_qwen3_asr_dir) -> None:
    """Qwen3-ASR is a decoder with an audio tower whose rows replace the prompt's audio
    placeholders, not an encoder-decoder model: vLLM builds its config on any host (the
    plugin's own view of the architecture, `compat/qwen3_asr.py`) and it is the audio-language
    kind, its towers loaded (no `language_model_only`)."""
    from vllm_metal.config.kinds import kind_of

    config = _engine_config(tiny_qwen3_asr_dir, max_model_len=1024)
    assert not config.model_config.is_encoder_decoder
    assert config.model_config.is_multimodal_model
    assert not config.model_config.multimodal_config.language_model_only
    assert kind_of(config).name == "audio_language"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["--enable-lora", "qwen3_asr"]),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            ["--speculative-config", "qwen3_asr"],
        ),
    ],
    ids=["lora", "speculative"],
)
def test_what_qwen3_asr_is_not_served_with_is_refused_by_name(
    tiny_qwen3_asr_dir, kwargs, names
) -> None:
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_qwen3_asr_dir, max_model_len=1024, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message
    assert "audio-language" in message
    for name in names:
        assert name in message
