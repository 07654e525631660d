"""Proves the other endpoints work with the plugin: Anthropic messages, models, health, metrics,
tokenize/detokenize, and that --api-key is enforced.
"""

from __future__ import annotations

import pytest
import requests

pytestmark = [pytest.mark.server, pytest.mark.slow]


@pytest.fixture
def anthropic_client(vllm_server):
    import anthropic

    # vLLM's --api-key check reads the Authorization header, so the key goes in as a bearer
    # token (auth_token), not as Anthropic's x-api-key.
    return anthropic.Anthropic(
        base_url=vllm_server.base_url,
        api_key=None,
        auth_token=vllm_server.api_key,
        timeout=120,
        max_retries=0,
    )


MESSAGES = [{"role": "user", "content": "Tell me about the lighthouse."}]
GREEDY = {"temperature": 0.0}


def test_anthropic_messages(vllm_server, anthropic_client):
    r = anthropic_client.messages.create(
        model=vllm_server.model, max_tokens=6, messages=MESSAGES, extra_body=GREEDY
    )
    assert r.type == "message" and r.role == "assistant"
    assert r.stop_reason == "max_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    # With the qwen3 reasoning parser the text arrives as a thinking block, content as text.
    kinds = {block.type for block in r.content}
    assert kinds and kinds <= {"text", "thinking"}


def test_anthropic_messages_streaming(vllm_server, anthropic_client):
    events = []
    with anthropic_client.messages.stream(
        model=vllm_server.model,
        max_tokens=6,
        messages=MESSAGES,
        extra_body=GREEDY,
        system="Answer briefly.",
    ) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_anthropic_streaming_equals_non_streaming(vllm_server, anthropic_client):
    kwargs = {
        "model": vllm_server.model,
        "max_tokens": 8,
        "messages": MESSAGES,
        "extra_body": GREEDY,
    }
    full = anthropic_client.messages.create(**kwargs)
    with anthropic_client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()

    def text(message) -> str:
        return "".join(
            getattr(b, "text", None) or getattr(b, "thinking", "") for b in message.content
        )

    assert text(streamed) == text(full)


def test_anthropic_count_tokens_matches_usage(vllm_server, anthropic_client):
    counted = anthropic_client.messages.count_tokens(model=vllm_server.model, messages=MESSAGES)
    r = anthropic_client.messages.create(
        model=vllm_server.model, max_tokens=1, messages=MESSAGES, extra_body=GREEDY
    )
    assert counted.input_tokens == r.usage.input_tokens


def test_models_lists_the_served_model(vllm_server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [vllm_server.model]
    raw = vllm_server.get("/v1/models").json()["data"][0]
    assert raw["max_model_len"] == vllm_server.max_model_len
    assert raw["root"] == str(vllm_server.model_dir)


def test_health_and_metrics(vllm_server):
    assert requests.get(vllm_server.url("/health"), timeout=10).status_code == 200
    metrics = vllm_server.get("/metrics")
    assert metrics.status_code == 200
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert name in metrics.text


def test_metrics_count_generated_tokens(vllm_server, check):
    before = vllm_server.gauge("vllm:generation_tokens_total")
    check(
        vllm_server.post(
            "/v1/completions",
            {"model": vllm_server.model, "prompt": "hi", "max_tokens": 5, "ignore_eos": True},
        )
    )
    assert vllm_server.gauge("vllm:generation_tokens_total") - before == 5


def test_tokenize_matches_the_tokenizer_and_detokenize_inverts_it(vllm_server, check, tokenizer):
    text = "The capital of Japan is Tokyo. Mixing 12 numbers, ünïcödé and {json}."
    out = check(vllm_server.post("/tokenize", {"model": vllm_server.model, "prompt": text}))
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert out["tokens"] == expected and out["count"] == len(expected)
    back = check(vllm_server.post("/detokenize", {"model": vllm_server.model, "tokens": expected}))
    assert back["prompt"] == text


def test_tokenize_chat_messages_match_the_prompt_a_completion_uses(vllm_server, check):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokens = check(
        vllm_server.post("/tokenize", {"model": vllm_server.model, "messages": messages})
    )["tokens"]
    out = check(
        vllm_server.post(
            "/v1/chat/completions",
            {
                "model": vllm_server.model,
                "messages": messages,
                "max_tokens": 1,
                "return_token_ids": True,
            },
        )
    )
    assert out["prompt_token_ids"] == tokens


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/messages"),
    ],
)
@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no-key", "wrong-key"])
def test_api_key_is_enforced(vllm_server, method, path, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": vllm_server.model, "prompt": "hi", "max_tokens": 1}
    r = requests.request(method, vllm_server.url(path), json=body, headers=headers, timeout=30)
    assert r.status_code == 401, r.text


def test_health_needs_no_key(vllm_server):
    # Health probes (load balancers, orchestrators) carry no credentials.
    assert requests.get(vllm_server.url("/health"), timeout=30).status_code == 200
    r = requests.get(vllm_server.url("/v1/models"), headers=vllm_server.headers, timeout=30)
    assert r.status_code == 200
