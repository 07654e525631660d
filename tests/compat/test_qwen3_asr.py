"""The plugin's vLLM view of Qwen3-ASR (`compat/qwen3_asr.py`): the transcription prompt it
writes for a request (context, language, translation target), with control tokens of the
request's own text removed, and the transcript cut from the model's answer (whole or streamed)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.tiny_qwen3_asr import AUDIO_END, AUDIO_PAD, AUDIO_START, transcription_prompt


@pytest.fixture(scope="module")
def model_config(tiny_qwen3_asr_dir):
    from vllm.config import ModelConfig

    from vllm_metal.compat import vllm_models

    vllm_models.install()  # as the platform does before vLLM builds a model config
    return ModelConfig(model=str(tiny_qwen3_asr_dir), max_model_len=1024)


def _prompt_text(model_config, **fields) -> str:
    from transformers import AutoTokenizer
    from vllm.config import SpeechToTextConfig
    from vllm.config.speech_to_text import SpeechToTextParams

    from vllm_metal.compat.qwen3_asr import Qwen3ASRForConditionalGeneration

    clip = np.zeros(16000, dtype=np.float32)
    params = SpeechToTextParams(
        audio=clip, stt_config=SpeechToTextConfig(), model_config=model_config, **fields
    )
    prompt = Qwen3ASRForConditionalGeneration.get_generation_prompt(params)
    assert prompt["multi_modal_data"]["audio"] is clip
    tokenizer = AutoTokenizer.from_pretrained(model_config.model)
    return tokenizer.decode(prompt["prompt_token_ids"])


def test_the_prompt_holds_the_clip_between_audio_markers(model_config) -> None:
    assert _prompt_text(model_config) == transcription_prompt()
    assert f"{AUDIO_START}{AUDIO_PAD}{AUDIO_END}" in transcription_prompt()


def test_a_language_opens_the_answer_and_a_context_is_a_system_turn(model_config) -> None:
    text = _prompt_text(model_config, language="fr", request_prompt="<|im<|x|>_end|>Paris")
    assert text == (
        "<|im_start|>system\nParis<|im_end|>\n"
        + transcription_prompt()
        + "language French<asr_text>"
    )


def test_a_translation_names_its_target_language(model_config) -> None:
    text = _prompt_text(model_config, language="fr", task_type="translate", to_language="en")
    assert text.endswith("<|im_start|>assistant\nlanguage English<asr_text>")


def test_the_transcript_follows_the_answers_header() -> None:
    from vllm_metal.compat.qwen3_asr import Qwen3ASRForConditionalGeneration as Model

    assert Model.post_process_output("language English<asr_text>hello there") == "hello there"
    assert Model.post_process_output("no header") == "no header"


def _streamed(deltas: list[str]) -> str:
    from vllm_metal.compat.qwen3_asr import Qwen3ASRForConditionalGeneration as Model

    post = Model.get_streaming_post_processor_cls()()
    last = len(deltas) - 1
    return "".join(post.process_delta(d, i == last) for i, d in enumerate(deltas))


def test_a_stream_leaves_out_the_answers_header() -> None:
    assert _streamed(["lang", "uage Eng", "lish<asr", "_text>hel", "lo ", "there"]) == "hello there"
    # Without a header everything is sent, also text that began like one.
    assert _streamed(["la", "ter today"]) == "later today"
    assert _streamed(["hello", " there"]) == "hello there"
    assert _streamed(["language"]) == "language"
