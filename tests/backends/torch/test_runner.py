"""The torch backend's runner on one engine under pressure: a KV pool so small that vLLM preempts
requests, 16-token prefill chunks, prefix-cache hits and prompt logprobs across chunks; every
token equals transformers float32."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens
from tests.fixtures.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

TORCH = {"VLLM_METAL_BACKEND": "mps"}
NEW_TOKENS = 40
MIXED = random_prompts(11, [1, 5, 17, 40, 75])
PREFIX = random_prompts(12, [48])[0]
HITS = [PREFIX + tail for tail in random_prompts(13, [3, 9])]
# Tiny Qwen3: 2 layers x (K + V) x 2 KV heads x 64 x 4 bytes = 2 KiB a token, 32 KiB a block.
BLOCK_BYTES = 32 * 2**10


@pytest.fixture(scope="module")
def pressure_run(tiny_model_dir):
    model = tiny_model_dir("qwen3")
    engine = {
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        # 11 usable blocks (176 tokens) for requests of up to 115: vLLM preempts some.
        "kv_cache_memory_bytes": 12 * BLOCK_BYTES,
        "max_model_len": 128,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, prompt_logprobs=1)]},
        {"prompts": [PREFIX + [5]], "params": [greedy(4)]},
        {"prompts": HITS, "params": [greedy(NEW_TOKENS)]},
    ]
    results, metrics = run_engine_job(model, jobs, engine=engine, env=TORCH, with_metrics="per_job")
    return model, results, metrics


def test_preempted_chunked_requests_equal_transformers(pressure_run):
    model, (mixed, _, _), metrics = pressure_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)


def test_prompt_logprobs_across_chunks_equal_transformers(pressure_run):
    model, (mixed, _, _), _ = pressure_run
    for prompt, result in zip(MIXED, mixed):
        rows = result["prompt_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None
        ref = hf_logprobs(model, prompt)
        for pos in range(1, len(prompt)):
            got = rows[pos][str(prompt[pos])]
            assert abs(got - ref[pos - 1, prompt[pos]]) < 1e-3, (pos, got)


def test_prefix_cache_hits_equal_transformers(pressure_run):
    model, (_, _, hits), _ = pressure_run
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    assert tokens(hits) == hf_greedy(model, HITS, NEW_TOKENS)
