"""Proves `vllm serve` serves a Qwen3.5 checkpoint as published (the tiny vision-language wrapper,
`tests.fixtures.tiny_qwen3_5`) as its language model: a completion's greedy tokens equal
transformers float32, a chat request with an image or a video gets a 400 naming the modality,
and the server goes on answering.

vLLM cannot import its own Qwen3.5 module here (torchvision), so this also proves the path the
plugin gives vLLM instead (`compat.vllm_models`) holds end to end: resolution, the hybrid
startup, the front end's item-count check and the engine.
"""

from __future__ import annotations

import base64
import io

import pytest

from tests.serving.conftest import greedy_completion

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

SERVED = "tiny-qwen3-5"


@pytest.fixture
def server(server_slot, tiny_qwen3_5_dir):
    return server_slot.get(
        ("qwen3_5", str(tiny_qwen3_5_dir)),
        tiny_qwen3_5_dir,
        served_name=SERVED,
        api_key=None,
        extra_args=["--max-model-len", "512"],
    )


def _png_data_url() -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("part", "modality"),
    [
        ({"type": "image_url", "image_url": {"url": _png_data_url()}}, "image"),
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t"}},
            "video",
        ),
    ],
    ids=["image", "video"],
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
