"""Proves `vllm serve` serves a Gemma 4 checkpoint as published (the tiny
`Gemma4ForConditionalGeneration` of `tests.fixtures.tiny_gemma4_vl`) as its language model where
vLLM's Gemma 4 processor does not import (here: it needs torchvision): a completion's greedy
tokens equal transformers float32 and a chat completion answers through the checkpoint's template;
a chat request with an image, a video or an audio clip gets a 400 naming the modality, and the
server goes on answering.

This holds the path the plugin gives vLLM for the wrapper (`compat.vllm_models`: vLLM inspects
the architecture without importing its module; `config.multimodal`: language-model-only) end to
end, through the Gemma 4 text runner (two head sizes, layers reading earlier layers' K/V,
per-layer inputs).
"""

from __future__ import annotations

import base64
import io

import pytest

from tests.serving.conftest import greedy_completion

# The `full` tier: CI's budget holds Qwen3.5's server of the same language-model-only path.
pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server, pytest.mark.full]

SERVED = "tiny-gemma4"


@pytest.fixture
def server(server_slot, tiny_gemma4_vl_dir):
    return server_slot.get(
        ("gemma4", str(tiny_gemma4_vl_dir)),
        tiny_gemma4_vl_dir,
        served_name=SERVED,
        api_key=None,
        extra_args=["--max-model-len", "512"],
    )


def _png_data_url() -> str:
    from tests.fixtures.tiny_idefics3 import tiny_image

    buffer = io.BytesIO()
    tiny_image(0, (32, 32)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _wav_base64() -> str:
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 1600)
    return base64.b64encode(buffer.getvalue()).decode()


def test_text_is_served(server):
    greedy_completion(server)
    chat = {
        "model": SERVED,
        "messages": [{"role": "user", "content": "Tell me a short story."}],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text + server.context()
    out = r.json()
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("part", "modality"),
    [
        ({"type": "image_url", "image_url": {"url": _png_data_url()}}, "image"),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t"}},
            "video",
        ),
        ({"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}}, "audio"),
    ],
    ids=["image", "video", "audio"],
)
def test_media_is_refused_by_modality_and_text_is_served(server, part, modality):
    chat = {
        "model": SERVED,
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}
        ],
        "max_tokens": 4,
    }
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 400, r.text + server.context()
    assert f"At most 0 {modality}(s) may be provided in one prompt" in r.text, r.text
    assert server.alive(), server.context()
    greedy_completion(server)
