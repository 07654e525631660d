"""Proves bad requests get a 4xx naming the problem and leave the server answering as before
(the same greedy tokens after each abuse).
"""

from __future__ import annotations

from typing import Any

import pytest
import requests

pytestmark = [pytest.mark.server, pytest.mark.slow]

_FIRST_ANSWER: dict[str, list[int]] = {}


def greedy_answer(server: Any) -> list[int]:
    body = {
        "model": server.model,
        "prompt": "In the morning the village woke early.",
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, f"{r.status_code} {r.text}{server.context()}"
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture
def unchanged(vllm_server):
    """Asserts after the test that the server gives the same greedy tokens as before any abuse."""
    before = _FIRST_ANSWER.setdefault("tokens", greedy_answer(vllm_server))
    yield
    assert vllm_server.alive(), f"the server died{vllm_server.context()}"
    assert greedy_answer(vllm_server) == before, vllm_server.context()


def chat_body(server: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def completion_body(server: Any, **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "hi", "max_tokens": 4, **extra}


# (id, endpoint, body maker, expected status, words the error message must contain)
CASES = [
    (
        "unknown-model",
        "/v1/chat/completions",
        lambda s: chat_body(s, model="no-such-model"),
        404,
        ["no-such-model"],
    ),
    (
        "max-tokens-negative",
        "/v1/completions",
        lambda s: completion_body(s, max_tokens=-5),
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-zero",
        "/v1/chat/completions",
        lambda s: chat_body(s, max_tokens=0),
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-huge",
        "/v1/completions",
        lambda s: completion_body(s, max_tokens=10**9),
        400,
        ["max_tokens"],
    ),
    (
        "max-tokens-string",
        "/v1/completions",
        lambda s: completion_body(s, max_tokens="ten"),
        400,
        ["max_tokens"],
    ),
    (
        "temperature-string",
        "/v1/chat/completions",
        lambda s: chat_body(s, temperature="hot"),
        400,
        ["temperature"],
    ),
    (
        "temperature-negative",
        "/v1/chat/completions",
        lambda s: chat_body(s, temperature=-1),
        400,
        ["temperature"],
    ),
    (
        "messages-not-a-list",
        "/v1/chat/completions",
        lambda s: chat_body(s, messages="hi"),
        400,
        ["messages"],
    ),
    (
        "missing-prompt",
        "/v1/completions",
        lambda s: {"model": s.model, "max_tokens": 4},
        400,
        ["prompt"],
    ),
    ("top-p-zero", "/v1/completions", lambda s: completion_body(s, top_p=0), 400, ["top_p"]),
    ("n-zero", "/v1/completions", lambda s: completion_body(s, n=0), 400, ["n"]),
    (
        "logprobs-too-many",
        "/v1/completions",
        lambda s: completion_body(s, logprobs=1000),
        400,
        ["logprobs"],
    ),
    (
        "logit-bias-token-out-of-vocab",
        "/v1/chat/completions",
        lambda s: chat_body(s, logit_bias={"1000000": 5}),
        400,
        ["logit_bias", "1000000"],
    ),
    (
        "logit-bias-token-negative",
        "/v1/completions",
        lambda s: completion_body(s, logit_bias={"-3": 5}),
        400,
        ["logit_bias"],
    ),
    (
        "prompt-token-out-of-vocab",
        "/v1/completions",
        lambda s: completion_body(s, prompt=[1, 2, 999999]),
        400,
        ["999999"],
    ),
    (
        "invalid-json-schema",
        "/v1/chat/completions",
        lambda s: chat_body(
            s,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        ),
        400,
        ["no-such-type"],
    ),
    (
        "invalid-regex",
        "/v1/completions",
        lambda s: completion_body(s, structured_outputs={"regex": "(["}),
        400,
        ["regex"],
    ),
    (
        "min-tokens-above-max",
        "/v1/completions",
        lambda s: completion_body(s, min_tokens=9, max_tokens=3),
        400,
        ["min_tokens"],
    ),
    (
        "thinking-budget-negative",
        "/v1/chat/completions",
        lambda s: chat_body(s, thinking_token_budget=-7),
        400,
        ["thinking_token_budget"],
    ),
    (
        "image-to-text-model",
        "/v1/chat/completions",
        lambda s: chat_body(
            s,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                        }
                    ],
                }
            ],
        ),
        400,
        ["multimodal"],
    ),
    (
        "prompt-embeds-not-enabled",
        "/v1/completions",
        lambda s: {"model": s.model, "prompt_embeds": "AAAA", "max_tokens": 2},
        400,
        ["prompt_embeds"],
    ),
    (
        "tool-choice-unknown-function",
        "/v1/chat/completions",
        lambda s: chat_body(
            s,
            tools=[
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        ["tool_choice"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx_naming_the_problem(vllm_server, unchanged, case):
    _, path, make_body, status, words = case
    r = vllm_server.post(path, make_body(vllm_server))
    assert r.status_code == status, f"{r.status_code} {r.text}"
    error = r.json()["error"]
    message = error["message"] + " " + str(error.get("param") or "")
    for word in words:
        assert word in message, f"{word!r} not in error message {message!r}"


def test_malformed_json_body(vllm_server, unchanged):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"):
        r = requests.post(
            vllm_server.url(path),
            data=b'{"model": "x", "prompt": "unterminated',
            headers={**vllm_server.headers, "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, f"{path}: {r.status_code} {r.text}"
        assert "json" in r.text.lower(), r.text


def test_non_json_content(vllm_server, unchanged):
    r = requests.post(
        vllm_server.url("/v1/completions"),
        data=b"\x00\xff\xfe not json at all",
        headers={**vllm_server.headers, "Content-Type": "application/json"},
        timeout=30,
    )
    assert 400 <= r.status_code < 500, r.text


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_longer_than_max_model_len(vllm_server, unchanged, endpoint):
    long_text = "one two three four " * vllm_server.max_model_len  # ~4 tokens per repeat
    body = (
        completion_body(vllm_server, prompt=long_text)
        if endpoint == "/v1/completions"
        else chat_body(vllm_server, messages=[{"role": "user", "content": long_text}])
    )
    r = vllm_server.post(endpoint, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert str(vllm_server.max_model_len) in message and "context length" in message, message


def test_generation_stops_at_max_model_len(vllm_server, unchanged, check):
    # A prompt that leaves room for only a few tokens: max_tokens beyond that room is cut to it
    # (vLLM's behaviour on every backend), never past the context length.
    prompt = [10 + i % 700 for i in range(vllm_server.max_model_len - 6)]
    r = vllm_server.post(
        "/v1/completions",
        completion_body(vllm_server, prompt=prompt, max_tokens=50, ignore_eos=True),
    )
    out = check(r)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["completion_tokens"] == 6
    assert out["choices"][0]["finish_reason"] == "length"
    r = vllm_server.post("/v1/completions", completion_body(vllm_server, prompt=prompt + [5] * 7))
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text


def test_streaming_request_with_bad_parameter_fails_before_streaming(vllm_server, unchanged):
    r = vllm_server.post("/v1/chat/completions", chat_body(vllm_server, stream=True, max_tokens=-1))
    assert r.status_code == 400 and "max_tokens" in r.text, r.text


def test_many_bad_requests_in_a_burst(vllm_server, unchanged):
    import concurrent.futures

    bodies = [case[2](vllm_server) for case in CASES] * 3
    paths = [case[1] for case in CASES] * 3
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(
            pool.map(
                lambda pb: vllm_server.post(pb[0], pb[1]).status_code,
                zip(paths, bodies, strict=False),
            )
        )
    assert all(400 <= c < 500 for c in codes), codes
