"""Proves `vllm serve` with the plugin serves every family's tiny checkpoint: chat and completions,
streamed or not, greedy tokens equal to transformers', over-long prompts refused, disconnects freed.

Every family runs on both backends (`serving_backend`; the torch backend's variants with
--run-full); CI runs one torch-backend check on the main checkpoint.
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.serving.conftest import backend_env, greedy_completion

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

# qwen3 first: it is the main server's checkpoint, so that server is reused for it. In the `full`
# tier: Qwen2 and Mistral (their decoders and chat templates close to Qwen3's and Llama's; the
# engine tests run every family in CI) and GLM-4 (one of the families without an
# input-embeddings decoder in mlx-lm).
FAMILIES = [
    "qwen3",
    "llama",
    pytest.param("qwen2", marks=pytest.mark.full),
    pytest.param("mistral", marks=pytest.mark.full),
    "gemma3",
    pytest.param("glm4", marks=pytest.mark.full),
]


@pytest.fixture
def family_server(request, server_slot, tiny_model_dir, serving_backend):
    """The server of one family's tiny checkpoint on the `serving_backend`: the main server for
    qwen3, its own otherwise."""
    arch = request.param
    model_dir = tiny_model_dir(arch)
    if arch == "qwen3":
        return request.getfixturevalue("vllm_server")
    return server_slot.get(
        ("family", serving_backend, str(model_dir)),
        model_dir,
        served_name=f"tiny-{arch}",
        api_key=None,
        env=backend_env(serving_backend),
    )


def _sse(response: requests.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def _greedy_chat(server) -> tuple[dict, str]:
    """A greedy chat completion (non-streaming) of exactly 6 tokens: (request body, its text with
    any reasoning)."""
    chat = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me a short story."}],
        "max_tokens": 6,
        "temperature": 0.0,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text + server.context()
    out = r.json()
    assert out["usage"]["completion_tokens"] == 6
    message = out["choices"][0]["message"]
    return chat, (message.get("content") or "") + (message.get("reasoning") or "")


# In CI: the torch backend's server of the main checkpoint (the same one as the main server's mps
# variant, so a --run-full run does not start it twice) answers a completion with transformers'
# greedy tokens and a chat completion. The whole family test on it runs with --run-full.
@pytest.mark.parametrize("family_server", ["qwen3"], indirect=True)
@pytest.mark.parametrize("serving_backend", ["mps"], indirect=True)
def test_torch_backend_serves_completions_and_chat(family_server):
    greedy_completion(family_server)
    _, text = _greedy_chat(family_server)
    assert text


@pytest.mark.parametrize("family_server", FAMILIES, indirect=True)
def test_family_serves_chat_and_completions(family_server):
    server = family_server
    ctx = server.context

    # Completion, non-streaming: greedy tokens equal transformers float32 on the same prompt.
    body, choice = greedy_completion(server)

    # Completion, streaming: the same text, chunk by chunk.
    r = server.post("/v1/completions", {**body, "stream": True}, stream=True)
    assert r.status_code == 200, r.text + ctx()
    events = _sse(r)
    streamed = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert streamed == choice["token_ids"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]

    # Chat, non-streaming and streaming.
    chat, full_text = _greedy_chat(server)
    r = server.post(
        "/v1/chat/completions",
        {**chat, "stream": True, "stream_options": {"include_usage": True}},
        stream=True,
    )
    assert r.status_code == 200, r.text + ctx()
    events = _sse(r)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    text = "".join((d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
    assert text == full_text
    assert events[-1]["usage"]["completion_tokens"] == 6

    # A prompt longer than max_model_len is refused with 400.
    long_prompt = [10 + i % 500 for i in range(server.max_model_len + 1)]
    r = server.post("/v1/completions", {**body, "prompt": long_prompt, "return_token_ids": False})
    assert r.status_code == 400, r.text
    assert str(server.max_model_len) in r.json()["error"]["message"]

    if server.model != "tiny-qwen3":
        # No --reasoning-parser on this server: a thinking budget cannot be honoured.
        r = server.post("/v1/completions", {**body, "thinking_token_budget": 4})
        assert r.status_code == 400 and "reasoning" in r.json()["error"]["message"], r.text

    # A client that leaves mid-stream frees its blocks. The request asks for as many tokens as fit,
    # but a fast engine (the torch backend: ~1 s for 400 tokens here) can still finish it before a
    # client on a loaded machine has read three events, so the client tries again until it sees
    # its request hold blocks.
    longest = server.max_model_len - len(choice["prompt_token_ids"]) - 8
    busy = 0.0
    for _ in range(3):
        with server.post(
            "/v1/completions", {**body, "max_tokens": longest, "stream": True}, stream=True
        ) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith(b"data: ")
                if seen >= 3:
                    busy = server.gauge("vllm:kv_cache_usage_perc")
                    break
        if busy > 0:
            break
    assert busy > 0, "the cache showed no use while a request was streaming" + ctx()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            server.gauge("vllm:kv_cache_usage_perc") == 0
            and server.gauge("vllm:num_requests_running") == 0
        ):
            break
        time.sleep(0.25)
    assert server.gauge("vllm:kv_cache_usage_perc") == 0, ctx()
    assert server.gauge("vllm:num_requests_running") == 0, ctx()
