"""Proves a request the MLX runner cannot run (prompt embeddings, with --enable-prompt-embeds) gets
a 400 naming the parameter, and the server keeps serving.

The refusal is the platform's per-request check (`MetalPlatform.validate_request`), which runs in
the front end whatever the backend, so the test runs on both (`serving_backend`).
"""

from __future__ import annotations

import base64
import io

import pytest
import torch

from tests.serving.conftest import backend_env

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]


def test_prompt_embeds_are_refused_and_the_server_survives(
    server_slot, tiny_model_dir, serving_backend
):
    from vllm_metal.config.requests import PROMPT_EMBEDS_REFUSAL

    model_dir = tiny_model_dir("qwen3")
    server = server_slot.get(
        ("prompt-embeds", serving_backend, str(model_dir)),
        model_dir,
        served_name="tiny-qwen3-embeds",
        api_key=None,
        extra_args=("--enable-prompt-embeds",),
        env=backend_env(serving_backend),
    )
    buffer = io.BytesIO()
    torch.save(torch.randn(5, 256), buffer)
    body = {
        "model": server.model,
        "prompt_embeds": base64.b64encode(buffer.getvalue()).decode(),
        "max_tokens": 3,
    }
    r = server.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert PROMPT_EMBEDS_REFUSAL in r.json()["error"]["message"]
    ok = server.post("/v1/completions", {"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text + server.context()
