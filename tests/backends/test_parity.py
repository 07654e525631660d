"""Greedy tokens and logprobs of both backends' runners (MLX, and torch: VLLM_METAL_BACKEND=mps)
equal transformers float32 and vLLM's CPU backend; sampling fields go through vLLM's sampler."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.conftest import FAMILIES
from tests.backends.mlx.runner.jobs import (
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
    vllm_cpu_job,
)
from vllm_metal.testing.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

NEW_TOKENS = 32

# Each backend's engine environment, and the families whose parity run CI's time holds on it
# (the others are in the `full` tier; Qwen3 on the torch backend: tests/backends/torch/).
BACKEND_ENV = {"mlx": {}, "mps": {"VLLM_METAL_BACKEND": "mps"}}
IN_CI = {
    "mlx": ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"),
    "mps": ("gemma3",),
}


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
    ]


# Mixed lengths submitted together: single-token, shorter than a block, several blocks, longer
# than the tiny models' sliding window (32) and than the forced prefill chunk (16).
MIXED = random_prompts(1, [1, 5, 17, 40, 75])
SHARED_PREFIX = random_prompts(2, [48])[0]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(3, [3, 9])]


def greedy_parity_round(model, logprobs: int | None = None, backend: str = "mlx") -> list[dict]:
    """The mixed batch in 16-token chunks, then a prefix-cache round, on one engine: greedy tokens
    equal transformers float32 and the shared prefix is served from cached blocks. Returns the
    mixed batch's results."""
    engine = {"max_num_batched_tokens": 16, "enable_prefix_caching": True}
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=logprobs)]},
        {"prompts": [SHARED_PREFIX + [5]], "params": [greedy(4)]},
        {"prompts": PREFIX_HITS, "params": [greedy(NEW_TOKENS)]},
    ]
    mixed, _, hits = run_engine_job(model, jobs, engine=engine, env=BACKEND_ENV[backend])

    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens(hits) == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    # The prefix-sharing prompts were served from cached blocks (3 full blocks of 16).
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    return mixed


@pytest.mark.parametrize(("backend", "arch"), backend_arch_params())
def test_greedy_and_logprobs_match_transformers(family_models, backend, arch):
    model = family_models[arch]
    mixed = greedy_parity_round(model, logprobs=1, backend=backend)

    for prompt, result in zip(MIXED, mixed):
        sample = result["outputs"][0]
        seq = prompt + sample["token_ids"]
        ref = hf_logprobs(model, seq)
        for step, token in enumerate(sample["token_ids"]):
            got = sample["logprobs"][step][str(token)]
            want = ref[len(prompt) - 1 + step, token]
            assert abs(got - want) < 1e-3, (arch, step, got, want)


def test_head_size_without_a_metal_kernel(tiny_model_dir):
    """Head size 32 (no Metal kernel) takes the generic path: still token-identical, through a
    mixed batch, chunked prefill and a prefix-cache round."""
    from vllm_metal import ops

    model = tiny_model_dir("llama", head_dim=32, hidden_size=128, num_heads=4, num_kv_heads=2)
    assert 32 not in ops.HEAD_SIZES
    greedy_parity_round(model)


# Deterministic processors: vLLM's CPU backend must give the very same tokens.
DETERMINISTIC_VARIANTS = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.3},
    {"logit_bias": {"100": 100.0}},
    {"allowed_token_ids": list(range(100, 160))},
    {"bad_words": ["the", "and"]},
    {"min_tokens": 10, "stop_token_ids": [2, 4], "ignore_eos": False},
]


@pytest.mark.parametrize("backend", BACKEND_ENV)
def test_same_tokens_as_vllm_cpu_backend(family_models, backend):
    """Penalties, biases and token constraints run through vLLM's own sampler: same tokens."""
    model = family_models["qwen3"]
    prompts = random_prompts(4, [7, 23])
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS)]},
        {"prompts": prompts, "params": [greedy(16)]},
    ]
    for variant in DETERMINISTIC_VARIANTS:
        jobs.append({"prompts": prompts, "params": [greedy(16, **variant)]})
    ours = run_engine_job(model, jobs, env=BACKEND_ENV[backend])
    theirs = vllm_cpu_job(model, jobs)
    assert tokens(ours[0]) == tokens(theirs[0])
    assert tokens(ours[1]) == tokens(theirs[1])
    plain, variants = ours[1], ours[2:]
    for variant, a, b in zip(DETERMINISTIC_VARIANTS, variants, theirs[2:]):
        assert tokens(a) == tokens(b), variant
    # The variants that must change greedy output on these prompts did.
    for i in (1, 2, 3):
        assert tokens(variants[i]) != tokens(plain), DETERMINISTIC_VARIANTS[i]
    assert all(t == [100] * 16 for t in tokens(variants[2]))
    assert all(set(t) <= set(range(100, 160)) for t in tokens(variants[3]))


def _probs(model, prompt: list[int], sample: list[int]) -> np.ndarray:
    """HF float32 next-token probabilities at each generated position of `sample`."""
    logprobs = hf_logprobs(model, prompt + sample)[len(prompt) - 1 : -1]
    return np.exp(logprobs.astype(np.float64))


@pytest.mark.parametrize("backend", BACKEND_ENV)
def test_random_sampling_respects_truncation(family_models, backend):
    """top_k / top_p / min_p only ever draw tokens their rule admits (checked on HF logits)."""
    model = family_models["qwen3"]
    prompts = random_prompts(6, [9, 30])
    base = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    variants = [
        {"top_k": 3, "seed": 1},
        {"top_p": 0.5, "seed": 2},
        {"min_p": 0.3, "seed": 3},
        {"n": 3, "seed": 4},
    ]
    jobs = [{"prompts": prompts, "params": [{**base, **v}]} for v in variants]
    top_k, top_p, min_p, multi = run_engine_job(model, jobs, env=BACKEND_ENV[backend])
    for prompt, res in zip(prompts, top_k):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            assert (probs[step] > probs[step, tok]).sum() < 3
    for prompt, res in zip(prompts, top_p):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            above = probs[step][probs[step] > probs[step, tok] + 1e-6].sum()
            assert above < 0.5 + 1e-4
    for prompt, res in zip(prompts, min_p):
        sample = res["outputs"][0]["token_ids"]
        probs = _probs(model, prompt, sample)
        for step, tok in enumerate(sample):
            assert probs[step, tok] >= 0.3 * probs[step].max() - 1e-5
    for res in multi:
        samples = [o["token_ids"] for o in res["outputs"]]
        assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1


@pytest.mark.parametrize("backend", BACKEND_ENV)
def test_seeded_sampling_is_reproducible(family_models, backend):
    """A seeded request draws the same tokens whatever runs beside it: again later in the same
    engine, in another order; another seed draws others."""
    model = family_models["llama"]
    prompts = random_prompts(5, [6, 19, 33])
    params = [
        {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    ]
    other = [{**params[0], "seed": 4321}]
    jobs = [
        {"prompts": prompts, "params": params},
        {"prompts": prompts, "params": other},
        {"prompts": prompts[::-1], "params": params},
    ]
    first, second, again = run_engine_job(model, jobs, env=BACKEND_ENV[backend])
    assert tokens(again)[::-1] == tokens(first)
    assert tokens(first) != tokens(second)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sync_and_async_scheduling_give_the_same_tokens(family_models, async_scheduling):
    """Async scheduling (step N+1 scheduled while step N computes) changes nothing in the output,
    including with chunked prefill, prefix hits and preemption from a small KV pool."""
    model = family_models["qwen2"]
    engine = {
        "async_scheduling": async_scheduling,
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 24 * 32 * 2**10,  # 24 blocks: preemption
        "max_model_len": 256,
    }
    prompts = MIXED + PREFIX_HITS
    (batch,) = run_engine_job(model, [{"prompts": prompts, "params": [greedy(40)]}], engine=engine)
    assert tokens(batch) == hf_greedy(model, prompts, 40)
