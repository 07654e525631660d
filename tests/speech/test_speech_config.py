"""Startup checks for speech-to-text models: Whisper is served by the MLX backend's speech
runner; what that runner does not run beside it, and speech models of other shapes, are refused
while vLLM builds its config, naming the setting or the architecture."""

from __future__ import annotations

from pathlib import Path

import pytest


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=448, **kwargs).create_engine_config()


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


def test_qwen3_asr_is_refused_naming_its_architecture() -> None:
    """Qwen3-ASR is a decoder with an audio tower whose embeddings are merged into the prompt,
    not an encoder-decoder model: the speech runner cannot serve it, and the multimodal kind
    refuses it by architecture. On Linux vLLM stops earlier (inspecting the class imports
    torchvision), so the table is checked on the model-config fields it reads."""
    from types import SimpleNamespace

    from vllm_metal.config.kinds import kind_of
    from vllm_metal.config.table import refusal

    model_config = SimpleNamespace(
        model="Qwen/Qwen3-ASR-1.7B",
        is_multimodal_model=True,
        is_encoder_decoder=False,
        hf_config=SimpleNamespace(
            model_type="qwen3_asr", architectures=["Qwen3ASRForConditionalGeneration"]
        ),
    )
    config = SimpleNamespace(model_config=model_config)
    assert kind_of(config).name == "multimodal"
    assert "model='Qwen/Qwen3-ASR-1.7B' (qwen3_asr, Qwen3ASRForConditionalGeneration)" in (
        refusal(config, "mlx")
    )
