"""Qwen3-ASR through `vllm serve` on the MLX runner: WAV uploads to `/v1/audio/transcriptions`
(the official `openai` client) give transformers float32's greedy transcript.

Oracle: `Qwen3ASRForConditionalGeneration.generate` on the chat turns Qwen3-ASR transcribes with
(the user turn holding the clip; with a language, the assistant turn opened by
`language <Name><asr_text>`), decoded with the checkpoint's tokenizer without special tokens and
cut after the model's own `<asr_text>` tag where it wrote one.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.qwen3_asr_oracle import qwen3_asr_generate
from tests.fixtures.tiny_qwen3_asr import ASR_TEXT, audio_clip, transcription_prompt, wav_bytes

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.full, pytest.mark.own_server]

SERVED = "tiny-qwen3-asr"
MAX_TOKENS = 16
CLIPS = [(0, 1.5), (2, 3.5), (3, 4.5)]


@pytest.fixture
def server(server_slot, tiny_qwen3_asr_dir):
    return server_slot.get(
        ("qwen3_asr", str(tiny_qwen3_asr_dir)),
        tiny_qwen3_asr_dir,
        served_name=SERVED,
        api_key=None,
        extra_args=["--max-model-len", "1024"],
    )


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


def _text(text: str) -> str:
    """The random model emits byte tokens: vLLM's detokenizer holds back an incomplete UTF-8
    sequence at the end, where a one-shot decode writes replacement characters."""
    return text.rstrip("\ufffd").strip()


def _as_sent(clip: np.ndarray) -> np.ndarray:
    """The clip as the server decodes it from `wav_bytes` (16-bit PCM)."""
    import soundfile

    samples, _ = soundfile.read(io.BytesIO(wav_bytes(clip)), dtype="float32")
    return samples


def _oracle_text(tiny_qwen3_asr_dir, clip: np.ndarray, header: str = "") -> str:
    tokens = qwen3_asr_generate(
        tiny_qwen3_asr_dir, transcription_prompt() + header, [_as_sent(clip)], MAX_TOKENS
    )
    text = AutoTokenizer.from_pretrained(tiny_qwen3_asr_dir).decode(
        tokens, skip_special_tokens=True
    )
    if ASR_TEXT in text:
        text = text.rsplit(ASR_TEXT, 1)[1]
    return _text(text)


def _transcribe(client, clip: np.ndarray, **kwargs):
    return client.audio.transcriptions.create(
        model=SERVED,
        file=("clip.wav", wav_bytes(clip), "audio/wav"),
        temperature=0.0,
        extra_body={"max_completion_tokens": MAX_TOKENS, "ignore_eos": True},
        **kwargs,
    )


def test_transcriptions_equal_transformers(client, tiny_qwen3_asr_dir) -> None:
    clips = [audio_clip(*c) for c in CLIPS]
    want = [_oracle_text(tiny_qwen3_asr_dir, c) for c in clips]
    assert len(set(want)) == len(clips)  # the audio decides the text
    assert [_text(_transcribe(client, c).text) for c in clips] == want
    with ThreadPoolExecutor(len(clips)) as pool:
        concurrent = list(pool.map(lambda c: _transcribe(client, c), clips))
    assert [_text(r.text) for r in concurrent] == want


def test_language_opens_the_answer(client, tiny_qwen3_asr_dir) -> None:
    clip = audio_clip(*CLIPS[1])
    want = _oracle_text(tiny_qwen3_asr_dir, clip, header=f"language English{ASR_TEXT}")
    assert want != _oracle_text(tiny_qwen3_asr_dir, clip)
    assert _text(_transcribe(client, clip, language="en").text) == want


def test_streamed_transcription_equals_the_oracle(server, tiny_qwen3_asr_dir) -> None:
    """`stream=true`: server-sent chunks whose deltas add up to the transcript."""
    import json

    clip = audio_clip(*CLIPS[2])
    data = {
        "model": SERVED,
        "temperature": "0",
        "max_completion_tokens": str(MAX_TOKENS),
        "ignore_eos": "true",
        "stream": "true",
    }
    files = {"file": ("clip.wav", wav_bytes(clip), "audio/wav")}
    response = server.post("/v1/audio/transcriptions", None, files=files, data=data, stream=True)
    assert response.status_code == 200, response.text
    deltas = []
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        deltas.extend(c["delta"].get("content") or "" for c in chunk["choices"])
    assert len(deltas) > 1
    assert _text("".join(deltas)) == _oracle_text(tiny_qwen3_asr_dir, clip)
