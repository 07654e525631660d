"""Greedy tokens and logprobs of both backends' runners (MLX, and torch: VLLM_METAL_BACKEND=mps)
equal transformers float32; sampling fields go through vLLM's sampler (and give vLLM's CPU
backend's tokens: `full` tier).

Cost per family: one engine (the family matrix below), about 20 s of one CI worker.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tests.backends.conftest import FAMILIES
from tests.backends.mlx.runner.jobs import (
    PERSON_SCHEMA,
    greedy,
    kv_block_bytes,
    random_prompts,
    run_engine_job,
    tokens,
    vllm_cpu_job,
)
from tests.fixtures.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

NEW_TOKENS = 32

# Each backend's engine environment, and the families whose parity run CI's time holds on it
# (the others are in the `full` tier; the torch backend's CI parity run is Qwen3's, in
# tests/backends/torch/). Llama runs the generic adapter as Qwen2 and Qwen3 do (and CI loads it
# from GGUF and in float16).
BACKEND_ENV = {"mlx": {}, "mps": {"VLLM_METAL_BACKEND": "mps"}}
IN_CI = {
    "mlx": ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "olmo3"),
    "mps": (),
}
# The MLX matrix runs these families with async scheduling (step N+1 scheduled while step N
# computes) and the others without, so both pipelines meet chunks, prefix hits and preemption.
ASYNC_FAMILIES = ("qwen2", "mistral", "gemma3")
# ... and these with compiled decode steps (`runner/compiled.py`, on by default on a GPU only),
# so compiled steps meet the same schedules, with and without async scheduling.
COMPILED_FAMILIES = ("qwen3", "gemma3", "olmo3")


# Families a backend does not serve as transformers computes them: vLLM 0.32's Mistral class (the
# torch backend's model of `ministral3`) reads Llama 4's query scale only from Mistral's own
# params format (`llama_4_scaling`), not from the Hugging Face config's `rope_parameters`, so past
# `original_max_position_embeddings` its tokens part from transformers'.
NOT_SERVED_AS_TRANSFORMERS = {"mlx": (), "mps": ("ministral3",)}


def backend_arch_params() -> list:
    return [
        pytest.param(
            backend,
            arch,
            id=f"{backend}-{arch}",
            marks=() if arch in IN_CI[backend] else (pytest.mark.full,),
        )
        for backend in BACKEND_ENV
        for arch in FAMILIES
        if arch not in NOT_SERVED_AS_TRANSFORMERS[backend]
    ]


# Mixed lengths submitted together: single-token, shorter than a block, several blocks, longer
# than the tiny models' sliding window (32) and than the forced prefill chunk (16).
MIXED = random_prompts(1, [1, 5, 17, 40, 75])
SHARED_PREFIX = random_prompts(2, [48])[0]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(3, [3, 9])]
# Five 96-token sequences need 30 blocks of 16 tokens; the pool has 20 (16 hold one request of
# max_model_len 256).
POOL_BLOCKS = 20
PREEMPTED = random_prompts(7, [48] * 5)


PROMPT_LOGPROB_PROMPTS = random_prompts(8, [5, 37])


def greedy_parity_round(
    model,
    logprobs: int | None = None,
    backend: str = "mlx",
    engine: dict | None = None,
    env: dict | None = None,
) -> list[dict]:
    """The family matrix on one engine with 16-token prefill chunks: the mixed batch, a
    prefix-cache round, a batch too large for the pool (vLLM preempts and recomputes), and prompt
    logprobs across chunks. Greedy tokens equal transformers float32, the shared prefix is served
    from cached blocks, and prompt logprobs (each prompt token and the top 2) equal
    transformers'. Returns the mixed batch's results."""
    engine = {
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": POOL_BLOCKS * kv_block_bytes(model),
        "max_model_len": 256,
        "disable_log_stats": False,
        **(engine or {}),
    }
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=logprobs)]},
        {"prompts": [SHARED_PREFIX + [5]], "params": [greedy(4)]},
        {"prompts": PREFIX_HITS, "params": [greedy(NEW_TOKENS)]},
        {"prompts": PREEMPTED, "params": [greedy(48)]},
        {"prompts": PROMPT_LOGPROB_PROMPTS, "params": [greedy(2, prompt_logprobs=2)]},
    ]
    (mixed, _, hits, preempted, prompt_lp), metrics = run_engine_job(
        model, jobs, engine=engine, env={**BACKEND_ENV[backend], **(env or {})}, with_metrics=True
    )

    if not every_layer_slides(model):  # a 32-token window holds 3 blocks: nothing to preempt
        assert metrics.get("vllm:num_preemptions", 0) > 0, metrics
    assert tokens(preempted) == hf_greedy(model, PREEMPTED, 48)
    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens(hits) == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    # The prefix-sharing prompts were served from cached blocks (3 full blocks of 16).
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    for prompt, result in zip(PROMPT_LOGPROB_PROMPTS, prompt_lp):
        assert_prompt_logprobs_match_hf(model, prompt, result["prompt_logprobs"])
    return mixed


def every_layer_slides(model) -> bool:
    """Whether every attention layer keeps a sliding window (the tiny Mistral)."""
    config = json.loads((Path(model) / "config.json").read_text())
    layer_types = config.get("layer_types")
    if layer_types:
        return all(t == "sliding_attention" for t in layer_types)
    return bool(config.get("sliding_window"))


def assert_prompt_logprobs_match_hf(model, prompt: list[int], plp: list) -> None:
    """Prompt logprobs with top 2: the first entry is None, then the prompt token and the two
    likeliest, each within 1e-3 of transformers float32."""
    assert plp[0] is None and len(plp) == len(prompt)
    ref = hf_logprobs(model, prompt)
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        assert str(prompt[pos]) in entry and len(entry) >= 2
        assert abs(entry[str(prompt[pos])] - ref[pos - 1, prompt[pos]]) < 1e-3
        for t in np.argsort(-ref[pos - 1])[:2]:
            assert abs(entry[str(int(t))] - ref[pos - 1, t]) < 1e-3


@pytest.mark.parametrize(("backend", "arch"), backend_arch_params())
def test_greedy_and_logprobs_match_transformers(family_models, backend, arch):
    model = family_models[arch]
    engine = {"async_scheduling": arch in ASYNC_FAMILIES} if backend == "mlx" else {}
    env = {"VLLM_METAL_COMPILE": "1"} if backend == "mlx" and arch in COMPILED_FAMILIES else {}
    mixed = greedy_parity_round(model, logprobs=1, backend=backend, engine=engine, env=env)

    for prompt, result in zip(MIXED, mixed):
        sample = result["outputs"][0]
        seq = prompt + sample["token_ids"]
        ref = hf_logprobs(model, seq)
        for step, token in enumerate(sample["token_ids"]):
            got = sample["logprobs"][step][str(token)]
            want = ref[len(prompt) - 1 + step, token]
            assert abs(got - want) < 1e-3, (arch, step, got, want)


@pytest.mark.full  # the generic path differs from the kernels' on Metal only
def test_head_size_without_a_metal_kernel(tiny_model_dir):
    """Head size 32 (no Metal kernel) takes the generic path: still token-identical, through the
    family matrix (mixed batch, chunked prefill, preemption, prefix-cache round, prompt
    logprobs)."""
    from vllm_metal import ops

    model = tiny_model_dir("llama", head_dim=32, hidden_size=128, num_heads=4, num_kv_heads=2)
    assert 32 not in ops.HEAD_SIZES
    greedy_parity_round(model)


# Deterministic processors: vLLM's CPU backend must give the very same tokens.
DETERMINISTIC_VARIANTS = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    # Below 1 it boosts the prompt's tokens, which changes greedy output whatever the random
    # draw (a random model seldom repeats a token, so a penalty above 1 may change nothing).
    {"repetition_penalty": 0.2},
    {"logit_bias": {"100": 100.0}},
    {"allowed_token_ids": list(range(100, 160))},
    {"bad_words": ["the", "and"]},
    {"min_tokens": 10, "stop_token_ids": [2, 4], "ignore_eos": False},
]
DETERMINISTIC_PROMPTS = random_prompts(4, [7, 23])
DETERMINISTIC_JOBS = [
    {"prompts": MIXED, "params": [greedy(NEW_TOKENS)]},
    {"prompts": DETERMINISTIC_PROMPTS, "params": [greedy(16)]},
    *(
        {"prompts": DETERMINISTIC_PROMPTS, "params": [greedy(16, **v)]}
        for v in DETERMINISTIC_VARIANTS
    ),
    # One batch, one rule per request beside a plain one (each row's rules apply to it alone).
    {
        "prompts": [DETERMINISTIC_PROMPTS[0]] * (1 + len(DETERMINISTIC_VARIANTS)),
        "params": [greedy(16), *(greedy(16, **v) for v in DETERMINISTIC_VARIANTS)],
    },
]
TRUNCATION_PROMPTS = random_prompts(6, [9, 30])
TRUNCATION_VARIANTS = [
    {"top_k": 3, "seed": 1},
    {"top_p": 0.5, "seed": 2},
    {"min_p": 0.3, "seed": 3},
    {"n": 3, "seed": 4},
]
TRUNCATION_BASE = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
REGEX = "[a-c]{3}-[0-9]{2}"
GRAMMAR_JOBS = [
    {"prompts": ["Person:"] * 2, "params": [
        {"max_tokens": 200, "temperature": 0.8, "seed": 3, "structured_outputs": {"json": PERSON_SCHEMA}}
    ]},
    {"prompts": ["Pick:"], "params": [
        {"max_tokens": 8, "temperature": 1.0, "seed": 5,
         "structured_outputs": {"choice": ["red", "blue"]}}
    ]},
    {"prompts": ["Code:"], "params": [
        {"max_tokens": 12, "temperature": 1.0, "seed": 6, "structured_outputs": {"regex": REGEX}}
    ]},
]  # fmt: skip
SEEDED_PROMPTS = random_prompts(5, [6, 19, 33])
SEEDED = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "ignore_eos": True}


@pytest.fixture(scope="module", params=list(BACKEND_ENV))
def sampling_run(request, family_models) -> dict[str, list]:
    """Every sampling check of this module on one Qwen3 engine per backend, in this order: the
    deterministic processors, the truncation rules, grammar-constrained requests (vLLM's bitmask
    on either backend's logits), and seeded requests three times (another seed between, then in
    reverse order)."""
    model = family_models["qwen3"]
    groups = {
        "deterministic": DETERMINISTIC_JOBS,
        "truncation": [{"prompts": TRUNCATION_PROMPTS, "params": [{**TRUNCATION_BASE, **v}]}
                       for v in TRUNCATION_VARIANTS],
        "grammar": GRAMMAR_JOBS,
        "seeded": [
            {"prompts": SEEDED_PROMPTS, "params": [SEEDED]},
            {"prompts": SEEDED_PROMPTS, "params": [{**SEEDED, "seed": 4321}]},
            {"prompts": SEEDED_PROMPTS[::-1], "params": [SEEDED]},
        ],
    }  # fmt: skip
    engine = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    results = run_engine_job(
        model, [j for jobs in groups.values() for j in jobs], engine=engine,
        env=BACKEND_ENV[request.param],
    )  # fmt: skip
    out, start = {"model": model}, 0
    for name, jobs in groups.items():
        out[name], start = results[start : start + len(jobs)], start + len(jobs)
    return out


def test_sampling_fields_change_greedy_tokens_as_their_rule_says(sampling_run):
    """Penalties, biases and token constraints run through vLLM's own sampler on our logits."""
    plain, variants = sampling_run["deterministic"][1], sampling_run["deterministic"][2:-1]
    # The variants that must change greedy output on these prompts did.
    for i in (1, 2, 3):
        assert tokens(variants[i]) != tokens(plain), DETERMINISTIC_VARIANTS[i]
    assert all(t == [100] * 16 for t in tokens(variants[2]))
    assert all(set(t) <= set(range(100, 160)) for t in tokens(variants[3]))
    assert not any({2, 4} & set(t[:10]) for t in tokens(variants[5]))  # min_tokens holds stops
    # In one batch, each request's rule acts on its own row as it does alone.
    mixed = tokens(sampling_run["deterministic"][-1])
    assert mixed == [tokens(plain)[0], *(tokens(v)[0] for v in variants)]


@pytest.mark.full
def test_same_tokens_as_vllm_cpu_backend(sampling_run):
    """The deterministic processors give vLLM's CPU backend's very tokens (the peer vouches for
    the oracle, so this comparison lives in the `full` tier)."""
    theirs = vllm_cpu_job(sampling_run["model"], DETERMINISTIC_JOBS)
    for variant, ours, peer in zip([{}, {}, *DETERMINISTIC_VARIANTS, "one rule per row"],
                                   sampling_run["deterministic"], theirs):  # fmt: skip
        assert tokens(ours) == tokens(peer), variant


def _probs(model, prompt: list[int], sample: list[int]) -> np.ndarray:
    """HF float32 next-token probabilities at each generated position of `sample`."""
    logprobs = hf_logprobs(model, prompt + sample)[len(prompt) - 1 : -1]
    return np.exp(logprobs.astype(np.float64))


def test_random_sampling_respects_truncation(sampling_run):
    """top_k / top_p / min_p only ever draw tokens their rule admits (checked on HF logits)."""
    model = sampling_run["model"]
    top_k, top_p, min_p, multi = sampling_run["truncation"]
    for prompt, res in zip(TRUNCATION_PROMPTS, top_k):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            assert (probs[step] > probs[step, tok]).sum() < 3
    for prompt, res in zip(TRUNCATION_PROMPTS, top_p):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            above = probs[step][probs[step] > probs[step, tok] + 1e-6].sum()
            assert above < 0.5 + 1e-4
    for prompt, res in zip(TRUNCATION_PROMPTS, min_p):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            assert probs[step, tok] >= 0.3 * probs[step].max() - 1e-5
    for res in multi:
        samples = [o["token_ids"] for o in res["outputs"]]
        assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1


def test_seeded_sampling_is_reproducible(sampling_run):
    """A seeded request draws the same tokens whatever ran before or runs beside it: again later
    in the same engine (after every other sampling job of this module), in another order; another
    seed draws others."""
    first, second, again = sampling_run["seeded"]
    assert tokens(again)[::-1] == tokens(first)
    assert tokens(first) != tokens(second)


def test_grammar_bitmask_constrains_random_model(sampling_run):
    """JSON schema, choice and regex outputs of a random model obey their grammar."""
    as_json, choice, regex = sampling_run["grammar"]
    for r in as_json:
        assert r["outputs"][0]["finish_reason"] == "stop", r["outputs"][0]
        jsonschema.validate(json.loads(r["outputs"][0]["text"]), PERSON_SCHEMA)
    assert choice[0]["outputs"][0]["text"] in ("red", "blue")
    assert re.fullmatch(REGEX, regex[0]["outputs"][0]["text"])
