"""Speculative decoding end to end on the MLX runner: n-gram and draft-model engines against the
same model without speculation and against transformers float32.

Each engine starts once per module and runs every job its tests look at; the tests read their
part of the results and the engine's spec-decode counters after each job.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    COMPILED_ENV,
    PERSON_SCHEMA,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.backends.mlx.runner.stats import chi2_pvalue
from tests.fixtures.oracles import hf_greedy
from vllm_metal.testing.tiny_models import write_tiny_model

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
K = 3
# Repetitive prompts (the n-gram proposer finds matches) mixed with random ones, of lengths
# below, at and above the forced prefill chunk (16 tokens), submitted together.
REPETITIVE = [[20, 21, 22, 23, 24] * 6, [100, 101, 102] * 9 + [100]]
MIXED = REPETITIVE + random_prompts(11, [1, 9, 40])
# max_tokens 1..5 in one batch: drafts must stop at max_tokens - 1.
SHORT = [[40, 41, 42, 43] * 5 for _ in range(5)]
SHORT_PARAMS = [greedy(n) for n in range(1, 6)]
# Sampling under verification: many unseeded requests (seeded ones are verified by position and
# have their own test), tokens 2.. are verified drafts.
DIST_PROMPT = [[7, 8, 9, 10, 11, 12]]
DIST_N = 400
DIST_PARAMS = [
    {"max_tokens": 4, "temperature": 1.0, "top_k": 4, "ignore_eos": True} for _ in range(DIST_N)
]
# Seeded sampled requests on prompts the n-gram proposer finds matches in, beside a greedy one
# that drafts: run twice, the seeded ones give the same tokens both times and as without
# speculation, whatever the back-off decided.
SEEDED = REPETITIVE * 4 + [REPETITIVE[0]]
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(len(SEEDED) - 1)
] + [greedy(16)]
SAMPLED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.9, "top_p": 0.8, "seed": 1, "ignore_eos": True},
    {"max_tokens": 16, "temperature": 0.7, "top_k": 5, "seed": 2, "ignore_eos": True},
    {
        "max_tokens": 16,
        "temperature": 1.0,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.2,
        "seed": 3,
        "ignore_eos": True,
    },
]
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.2}
# Ten tokens allowed, three of them stop tokens, masked for the first ten: the rules a verifying
# step applies to each row besides penalties.
RULES = {"allowed_token_ids": list(range(20, 30)), "min_tokens": 10, "stop_token_ids": [20, 21, 22]}
STRUCTURED = [
    {
        "max_tokens": 120,
        "temperature": 0.8,
        "seed": 3,
        "structured_outputs": {"json": PERSON_SCHEMA},
    },
    {"max_tokens": 12, "temperature": 0.0, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}},
]

ENGINE = {
    "max_num_batched_tokens": 32,  # forces chunked prefill next to decodes
    "max_num_seqs": 8,  # with K=3, 8 x (1 + K) rows fit one step's token budget
    "enable_prefix_caching": True,
    "disable_log_stats": False,
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}
JOBS = [
    {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1)]},
    {"prompts": SHORT, "params": SHORT_PARAMS},
    {"prompts": DIST_PROMPT * DIST_N, "params": DIST_PARAMS},
    {"prompts": [REPETITIVE[0]] * 3, "params": SAMPLED_PARAMS},
    {"prompts": ["Person:", "Code:"], "params": STRUCTURED},
    # The first repetitive prompt again: served from cached blocks, drafted the same.
    {"prompts": [REPETITIVE[0]], "params": [greedy(NEW_TOKENS)]},
    {"prompts": SEEDED, "params": SEEDED_PARAMS},
    {"prompts": SEEDED, "params": SEEDED_PARAMS},
    {
        "prompts": [*REPETITIVE, REPETITIVE[0]],
        "params": [greedy(NEW_TOKENS, **PENALTIES)] * 2 + [greedy(NEW_TOKENS, **RULES)],
    },
    {"action": "async_scheduling"},  # last: the counter snapshots follow generating jobs only
]
(
    MIXED_JOB,
    SHORT_JOB,
    DIST_JOB,
    SAMPLED_JOB,
    STRUCTURED_JOB,
    CACHED_JOB,
    SEEDED_JOB,
    SEEDED_AGAIN_JOB,
    PENALIZED_JOB,
    ASYNC_JOB,
) = range(len(JOBS))
# Counters of the in-process engines (`small_draft`: compiled verification steps; `self_draft`:
# steps verified on the device).
VERIFY_COMPILED_JOB = DEVICE_VERIFIED_JOB = len(JOBS)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-models")
    target = write_tiny_model(root / "target", "qwen3")
    # A smaller draft with another KV shape (1 layer, 1 KV head) and other weights.
    draft = write_tiny_model(
        root / "draft", "qwen3", seed=5, num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=1
    )
    return {"target": target, "draft": draft}


def _run(models, speculative_config, env=None, engine=None, jobs=()):
    return run_engine_job(
        models["target"],
        [*JOBS, *jobs],
        engine={**ENGINE, "speculative_config": speculative_config, **(engine or {})},
        with_metrics="per_job",
        env=env,
    )


@pytest.fixture(scope="module")
def plain(models):
    return run_engine_job(models["target"], JOBS, engine=ENGINE, with_metrics="per_job")


@pytest.fixture(scope="module")
def ngram(models):
    return _run(
        models,
        {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
    )


@pytest.fixture(scope="module")
def self_draft(models):
    """The target as its own draft model: every greedy draft is the target's own argmax.
    Without the back-off (drafting with a copy of the target never pays), so every request
    drafts up to its cap. With async scheduling off: drafts then stop one short of max_tokens
    and the scheduler counts only the drafts the runner made, so the counts below are exact;
    `small_draft` runs the same draft-model path with async scheduling on."""
    return _run(
        models,
        {"method": "draft_model", "model": str(models["target"]), "num_speculative_tokens": K},
        env={"VLLM_METAL_SPEC_BACKOFF": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        engine={"async_scheduling": False},
        jobs=[{"action": "verified_on_device"}],
    )


@pytest.fixture(scope="module")
def small_draft(models):
    """With compiled decode and verification steps (`runner/compiled.py`), which the CPU
    device does not take by default: every comparison with `plain` (eager) holds for them."""
    return _run(
        models,
        {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": K},
        env=COMPILED_ENV,
        jobs=[{"action": "compiled_verify_steps"}],
    )


def test_engines_run_with_the_async_scheduling_expected(request):
    """Async scheduling is on with a draft model (vLLM's default), off where the engine asks
    for it off, and off with n-gram (vLLM turns it off for its host-side proposer); plain
    decoding, the reference of every comparison here, runs with it on."""
    expected = {"plain": True, "small_draft": True, "self_draft": False, "ngram": False}
    for name, on in expected.items():
        results, _ = request.getfixturevalue(name)
        assert results[ASYNC_JOB] is on, name


def test_verification_steps_compiled(small_draft):
    """Every comparison of `small_draft` with `plain` holds for steps verifying drafts in
    compiled forwards. Most of its steps verify nothing (the back-off pauses the small draft's
    poor requests) or also prefill (16-token chunks beside the decodes), which stay eager."""
    results, _ = small_draft
    assert results[VERIFY_COMPILED_JOB] >= 3, results[VERIFY_COMPILED_JOB]


def test_greedy_steps_verified_on_the_device(self_draft):
    """Every comparison of `self_draft` with `plain` (and its exact draft counts) holds for its
    greedy steps, verified from the device's argmax (`spec_decode.verify.device_verdicts`) where
    the others went to vLLM's `RejectionSampler`: the jobs of max_tokens 1 to 5, the
    prefix-cache hit and the logprobs job, whose logprobs equal plain decoding's."""
    results, _ = self_draft
    assert results[DEVICE_VERIFIED_JOB] >= 10, results[DEVICE_VERIFIED_JOB]


def _spec_counts(metrics: list[dict], job: int) -> dict[str, float]:
    """The spec-decode counters' increase during one job."""
    names = [
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    ]
    before = metrics[job - 1] if job > 0 else {}
    return {n.split("num_")[-1]: metrics[job].get(n, 0) - before.get(n, 0) for n in names}


@pytest.mark.parametrize("method", ["ngram", "self_draft", "small_draft"])
def test_greedy_equals_plain_and_transformers(request, models, plain, method):
    results, metrics = request.getfixturevalue(method)
    base, _ = plain
    assert tokens(results[MIXED_JOB]) == tokens(base[MIXED_JOB])
    assert tokens(results[MIXED_JOB]) == hf_greedy(models["target"], MIXED, NEW_TOKENS)
    counts = _spec_counts(metrics, MIXED_JOB)
    assert counts["draft_tokens"] > 0, counts  # speculation really ran
    # Logprobs of verified tokens are the target's, as without speculation.
    for spec_r, base_r in zip(results[MIXED_JOB], base[MIXED_JOB]):
        spec_lp, base_lp = spec_r["outputs"][0]["logprobs"], base_r["outputs"][0]["logprobs"]
        assert len(spec_lp) == NEW_TOKENS
        for a, b in zip(spec_lp, base_lp):
            for t, v in b.items():
                assert t in a and abs(a[t] - v) < 1e-4


@pytest.mark.parametrize("method", ["ngram", "self_draft", "small_draft"])
def test_greedy_with_penalties_and_rules_equals_plain(request, plain, method):
    """Greedy requests with presence, frequency and repetition penalties, or with allowed
    tokens and a minimum length before their stop tokens, verify their drafts with the drafts
    before each row counted (on the device, `verify.device_verdicts`): the tokens of decoding
    without drafts. (The penalties keep the outputs from repeating, so the n-gram proposer
    finds nothing to draft there.)"""
    results, metrics = request.getfixturevalue(method)
    base, _ = plain
    assert tokens(results[PENALIZED_JOB]) == tokens(base[PENALIZED_JOB])
    ruled = results[PENALIZED_JOB][-1]["outputs"][0]
    assert set(ruled["token_ids"]) <= set(RULES["allowed_token_ids"])
    assert ruled["finish_reason"] == "stop" and len(ruled["token_ids"]) >= RULES["min_tokens"]
    if method != "ngram":
        assert _spec_counts(metrics, PENALIZED_JOB)["draft_tokens"] > 0


def test_self_draft_accepts_every_draft(self_draft):
    _, metrics = self_draft
    counts = _spec_counts(metrics, MIXED_JOB)
    assert counts["draft_tokens"] >= 20
    assert counts["accepted_tokens"] == counts["draft_tokens"], counts


def test_ngram_accepts_on_repetitive_prompts(ngram):
    _, metrics = ngram
    counts = _spec_counts(metrics, MIXED_JOB)
    assert counts["accepted_tokens"] > 0, counts


@pytest.mark.parametrize("method", ["ngram", "self_draft", "small_draft"])
def test_max_tokens_1_to_5_exact_lengths(request, method):
    results, metrics = request.getfixturevalue(method)
    outs = [r["outputs"][0] for r in results[SHORT_JOB]]
    assert [len(o["token_ids"]) for o in outs] == [1, 2, 3, 4, 5]
    assert all(o["finish_reason"] == "length" for o in outs)
    if method == "self_draft":
        # Every draft is accepted, so the drafts are exactly the caps: max_tokens - 2 after the
        # first token (0, 0, 1, 2, 3), never a token the request could not return.
        assert _spec_counts(metrics, SHORT_JOB)["draft_tokens"] == 6


def test_chi2_pvalue_detects_a_shifted_distribution():
    rng = np.random.default_rng(0)
    a = rng.choice(4, size=400, p=[0.4, 0.3, 0.2, 0.1]).tolist()
    same = rng.choice(4, size=400, p=[0.4, 0.3, 0.2, 0.1]).tolist()
    shifted = rng.choice(4, size=400, p=[0.55, 0.25, 0.12, 0.08]).tolist()
    assert chi2_pvalue(a, same) > 0.01
    assert chi2_pvalue(a, shifted) < 1e-3


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_sampled_tokens_follow_the_distribution_without_speculation(request, plain, method):
    results, metrics = request.getfixturevalue(method)
    base, _ = plain
    spec = [r["outputs"][0]["token_ids"] for r in results[DIST_JOB]]
    ref = [r["outputs"][0]["token_ids"] for r in base[DIST_JOB]]
    assert all(len(t) == 4 for t in spec)
    for pos in range(1, 4):  # the first token comes from the prefill, the rest were drafted
        p = chi2_pvalue([tuple(t[: pos + 1]) for t in spec], [tuple(t[: pos + 1]) for t in ref])
        assert p > 1e-3, (pos, p)
    if method == "self_draft":
        # Sampled verification both accepted and rejected drafts (the argmax of the target).
        counts = _spec_counts(metrics, DIST_JOB)
        assert 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts


@pytest.mark.parametrize("method", ["ngram", "small_draft"])
def test_sampling_settings_and_seeds(request, plain, method):
    results, _ = request.getfixturevalue(method)
    outs = [r["outputs"][0]["token_ids"] for r in results[SAMPLED_JOB]]
    assert [len(o) for o in outs] == [16, 16, 16]
    # Seeded requests give the tokens they give without speculation: the first two draft and
    # are verified by position, the third (penalties) does not draft.
    base, _ = plain
    assert outs == [r["outputs"][0]["token_ids"] for r in base[SAMPLED_JOB]]


@pytest.mark.parametrize("method", ["ngram", "small_draft", "self_draft"])
def test_seeded_requests_repeat_with_and_without_speculation(request, plain, method):
    """With the back-off on (its default), a seeded sampled batch gives the same tokens run after
    run and the tokens it gives without speculation, while the greedy request beside it drafts;
    with the back-off off (self-drafting), the seeded requests draft too, and some of their
    drafts are accepted and some rejected."""
    results, metrics = request.getfixturevalue(method)
    base, _ = plain
    seeded = tokens(results[SEEDED_JOB])[:-1]
    assert len(set(map(tuple, seeded))) > 1  # sampled, not one greedy continuation
    assert seeded == tokens(results[SEEDED_AGAIN_JOB])[:-1]
    assert seeded == tokens(base[SEEDED_JOB])[:-1]
    assert tokens(results[SEEDED_JOB])[-1] == tokens(base[SEEDED_JOB])[-1]  # greedy
    counts = _spec_counts(metrics, SEEDED_JOB)
    if method == "ngram":
        assert counts["accepted_tokens"] > 0, counts
    if method == "self_draft":
        # The greedy request alone drafts fewer than 16 tokens in 16.
        assert counts["draft_tokens"] > 16, counts
        assert 0 < counts["accepted_tokens"] < counts["draft_tokens"], counts


@pytest.mark.parametrize("method", ["ngram", "self_draft", "small_draft"])
def test_structured_output_stays_valid(request, method):
    import jsonschema

    results, _ = request.getfixturevalue(method)
    as_json, regex = (r["outputs"][0] for r in results[STRUCTURED_JOB])
    assert as_json["finish_reason"] == "stop", as_json
    jsonschema.validate(json.loads(as_json["text"]), PERSON_SCHEMA)
    import re

    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex["text"]), regex


@pytest.mark.parametrize("method", ["ngram", "small_draft"])
def test_prefix_cache_hit_drafts_the_same(request, method):
    results, _ = request.getfixturevalue(method)
    (hit,) = results[CACHED_JOB]
    assert hit["num_cached_tokens"] >= 16
    assert hit["outputs"][0]["token_ids"] == results[MIXED_JOB][0]["outputs"][0]["token_ids"]


def test_preemption_and_resume_under_speculation(models):
    """A KV cache too small for the batch: requests are preempted and recomputed, the draft
    model's cache with them, and greedy output stays the target's."""
    prompts = random_prompts(21, [30, 34, 38, 42, 46, 50])
    spec = {"method": "draft_model", "model": str(models["draft"]), "num_speculative_tokens": K}
    engine = {
        **ENGINE,
        "max_model_len": 160,
        # 14 blocks of 16 tokens (target 2 KiB + draft 0.5 KiB per token): room for about two
        # requests at a time.
        "kv_cache_memory_bytes": 14 * 16 * 2560,
        "speculative_config": spec,
    }
    results, metrics = run_engine_job(
        models["target"],
        [{"prompts": prompts, "params": [greedy(64)]}],
        engine=engine,
        with_metrics="per_job",
    )
    assert metrics[0].get("vllm:num_preemptions", 0) > 0, metrics[0]
    assert tokens(results[0]) == hf_greedy(models["target"], prompts, 64)
