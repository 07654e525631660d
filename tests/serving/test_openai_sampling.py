"""Proves chat and text completions through `vllm serve` honour the sampling parameters clients use.

Greedy tokens, logprobs and penalties are checked against transformers float32 on the checkpoint.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPT = "The old lighthouse stood at the edge of the cliff"
CHAT = [{"role": "user", "content": "Tell me a short story about a fox."}]


def processed_greedy(
    model_dir: Path,
    prompt: list[int],
    num_tokens: int,
    *,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
) -> list[int]:
    """Greedy decoding from transformers' logits with vLLM's penalty semantics, written out.

    Repetition penalty (multiplicative) covers prompt and output tokens; frequency and presence
    penalties (subtractive) cover output tokens only.
    """
    from tests.fixtures.oracles import hf_logits

    out: list[int] = []
    for _ in range(num_tokens):
        logits = hf_logits(model_dir, prompt + out)[-1].astype(np.float64)
        if repetition_penalty != 1.0:
            for t in set(prompt) | set(out):
                logits[t] = (
                    logits[t] / repetition_penalty
                    if logits[t] > 0
                    else logits[t] * repetition_penalty
                )
        for t, count in Counter(out).items():
            logits[t] -= frequency_penalty * count + presence_penalty
        out.append(int(np.argmax(logits)))
    return out


def completion(server: Any, check: Any, **body: Any) -> dict[str, Any]:
    request = {
        "model": server.model,
        "prompt": PROMPT,
        "temperature": 0.0,
        "max_tokens": 8,
        "return_token_ids": True,
        **body,
    }
    return check(server.post("/v1/completions", request))


def test_chat_completion_reports_exact_usage(vllm_server, client, check):
    prompt_count = check(
        vllm_server.post("/tokenize", {"model": vllm_server.model, "messages": CHAT})
    )["count"]
    r = client.chat.completions.create(
        model=vllm_server.model,
        messages=CHAT,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.model == vllm_server.model
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_count
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == prompt_count + 7


def test_streaming_equals_non_streaming_and_reports_usage(vllm_server, client):
    kwargs = {"model": vllm_server.model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert text == full.choices[0].text
    assert len(streamed_ids) == 10
    # include_usage: exactly one final chunk with usage and no choices.
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and not chunks[-1].choices
    assert usage_chunks[0].usage.completion_tokens == 10
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streaming_with_usage(vllm_server, client):
    stream = client.chat.completions.create(
        model=vllm_server.model,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_greedy_tokens_and_logprobs_match_transformers(vllm_server, check):
    from tests.fixtures.oracles import hf_greedy, hf_logprobs

    # Token ids as keys: several byte-level tokens decode to the same text.
    out = completion(
        vllm_server,
        check,
        max_tokens=8,
        logprobs=3,
        ignore_eos=True,
        return_tokens_as_token_ids=True,
    )
    choice = out["choices"][0]
    prompt_ids, ids = choice["prompt_token_ids"], choice["token_ids"]
    assert ids == hf_greedy(vllm_server.model_dir, [prompt_ids], 8)[0]

    reference = hf_logprobs(vllm_server.model_dir, prompt_ids + ids)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    for i, (lp, top) in enumerate(
        zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=False)
    ):
        row = reference[len(prompt_ids) - 1 + i]
        assert lp == pytest.approx(float(row[ids[i]]), abs=2e-3)
        assert len(top) == 3  # greedy: the sampled token is the best one, already in the top 3
        top_ids = [int(k.removeprefix("token_id:")) for k in top]
        assert set(top_ids) == set(np.argsort(row)[::-1][:3].tolist())
        for t, value in zip(top_ids, top.values(), strict=False):
            assert value == pytest.approx(float(row[t]), abs=2e-3)


def test_chat_top_logprobs_are_sorted_and_greedy_picks_the_best(vllm_server, client):
    r = client.chat.completions.create(
        model=vllm_server.model,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert all(v <= 0 for v in values)
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)


def test_n_choices_and_seed_reproducibility(vllm_server, check):
    body = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    a = completion(vllm_server, check, n=3, seed=1234, **body)
    b = completion(vllm_server, check, n=3, seed=1234, **body)
    c = completion(vllm_server, check, n=3, seed=4321, **body)
    assert sorted(ch["index"] for ch in a["choices"]) == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == 3 * 8

    def ids(r: dict[str, Any]) -> list[list[int]]:
        return [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]

    assert ids(a) == ids(b), "the same seed must give the same samples"
    assert ids(a) != ids(c), "a different seed should give different samples"
    # The n samples of one request are not copies of each other.
    assert len({tuple(x) for x in ids(a)}) > 1


def test_seeded_sampling_is_independent_of_batch_neighbours(vllm_server, check):
    import concurrent.futures

    body = {"max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}
    body["ignore_eos"] = True
    alone = completion(vllm_server, check, **body)["choices"][0]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(completion, vllm_server, check, **body) for _ in range(2)]
        futures += [
            pool.submit(completion, vllm_server, check, **{**body, "seed": s}) for s in (1, 2)
        ]
        results = [f.result()["choices"][0]["token_ids"] for f in futures]
    assert results[0] == alone and results[1] == alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_plus_100_forces_the_token(vllm_server, check, temperature):
    forced = 300
    out = completion(
        vllm_server,
        check,
        max_tokens=6,
        temperature=temperature,
        seed=0,
        logit_bias={str(forced): 100},
    )
    assert out["choices"][0]["token_ids"] == [forced] * 6


def test_logit_bias_minus_100_bans_the_greedy_token(vllm_server, check):
    first = completion(vllm_server, check, max_tokens=1)["choices"][0]["token_ids"][0]
    out = completion(vllm_server, check, max_tokens=1, logit_bias={str(first): -100})
    assert out["choices"][0]["token_ids"][0] != first


def test_stop_string_truncates_and_reports_stop(vllm_server, check):
    full = completion(vllm_server, check, max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    # A stop string from the middle of the greedy continuation (plain ASCII, so decoding of
    # partial UTF-8 sequences cannot shift it).
    start = next(
        i for i in range(3, len(full) - 2) if full[i : i + 2].isascii() and full[i : i + 2].strip()
    )
    stop = full[start : start + 2]
    out = completion(vllm_server, check, max_tokens=16, ignore_eos=True, stop=[stop])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[: full.index(stop)]


def test_stop_token_ids(vllm_server, check):
    greedy = completion(vllm_server, check, max_tokens=8, ignore_eos=True)["choices"][0]
    stop_id = greedy["token_ids"][3]
    position = greedy["token_ids"].index(stop_id)
    out = completion(vllm_server, check, max_tokens=8, stop_token_ids=[stop_id])["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id
    assert out["token_ids"] == greedy["token_ids"][: position + 1]


def test_max_tokens_and_min_tokens_against_a_forced_eos(vllm_server, check):
    from vllm_metal.testing.tiny_models import IM_END, token_id

    eos = token_id(IM_END)
    bias = {str(eos): 100}
    # The bias makes end-of-sequence the first token ...
    out = completion(vllm_server, check, max_tokens=10, logit_bias=bias)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 1
    # ... and min_tokens holds it back for exactly that many tokens.
    out = completion(vllm_server, check, max_tokens=10, logit_bias=bias, min_tokens=5)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) == 6 and eos not in choice["token_ids"][:5]
    assert choice["token_ids"][5] == eos
    # max_tokens caps a generation that never ends on its own.
    out = completion(vllm_server, check, max_tokens=3, ignore_eos=True, logit_bias=bias)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["token_ids"] == [eos] * 3


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.8},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 0.7, "presence_penalty": 0.5, "repetition_penalty": 1.3},
    ],
    ids=["repetition", "frequency", "presence", "combined"],
)
def test_penalties_match_an_independent_implementation(vllm_server, check, penalties):
    # A prompt that repeats itself, and 16 tokens, over which the tiny Qwen3's continuation repeats
    # tokens often enough that every penalty here changes it (the last check depends on the draw).
    prompt, n = "one two one two one two one two", 16
    out = completion(vllm_server, check, prompt=prompt, max_tokens=n, ignore_eos=True, **penalties)
    choice = out["choices"][0]
    expected = processed_greedy(vllm_server.model_dir, choice["prompt_token_ids"], n, **penalties)
    assert choice["token_ids"] == expected
    plain = completion(vllm_server, check, prompt=prompt, max_tokens=n, ignore_eos=True)
    assert plain["choices"][0]["token_ids"] != expected, "the penalty changed nothing"
