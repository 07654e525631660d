"""LFM2 (short convolutions between attention layers) on the torch backend, one engine under
pressure: 16-token prefill chunks that carry each request's convolution window from chunk to chunk,
and a KV pool so small that vLLM preempts requests (a resumed request recomputes its window from a
fresh state page). Greedy tokens equal transformers float32; sampled and prompt logprobs are within
1e-3 of its; prefix caching is off for the model (no cached tokens, still the right tokens)."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

TORCH = {"VLLM_METAL_BACKEND": "mps"}
NEW_TOKENS = 40
MIXED = random_prompts(31, [1, 2, 3, 5, 17, 40, 75])
# The longest prompt again with new tails: served from its cached blocks if prefix caching were on.
REPEATS = [MIXED[-1] + tail for tail in random_prompts(32, [2, 7])]
# Tiny LFM2: one attention layer, 16 tokens x (K + V) x 2 KV heads x 64 x 4 bytes = 16 KiB a block;
# each of the 3 convolution layers' window page is padded to the same 16 KiB and takes one block
# per running request.
BLOCK_BYTES = 16 * 2**10


@pytest.fixture(scope="module")
def lfm2_run(tiny_lfm2_dir):
    model = tiny_lfm2_dir
    engine = {
        "max_num_batched_tokens": 16,
        # 13 usable blocks: a request of 115 tokens takes 8 + 3; vLLM preempts some of the 7.
        "kv_cache_memory_bytes": 14 * BLOCK_BYTES,
        "max_model_len": 128,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1, prompt_logprobs=1)]},
        {"prompts": REPEATS, "params": [greedy(16)]},
    ]
    results, metrics = run_engine_job(model, jobs, engine=engine, env=TORCH, with_metrics="per_job")
    return model, results, metrics


def test_preempted_chunked_requests_equal_transformers(lfm2_run):
    model, (mixed, _), metrics = lfm2_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)


def test_logprobs_equal_transformers(lfm2_run):
    model, (mixed, _), _ = lfm2_run
    assert_logprobs_match_hf(model, MIXED, mixed)
    for prompt, result in zip(MIXED, mixed):
        rows = result["prompt_logprobs"]
        assert len(rows) == len(prompt) and rows[0] is None
        ref = hf_logprobs(model, prompt)
        for pos in range(1, len(prompt)):
            got = rows[pos][str(prompt[pos])]
            assert abs(got - ref[pos - 1, prompt[pos]]) < 1e-3, (pos, got)


def test_prefix_caching_is_off_and_repeats_are_recomputed(lfm2_run):
    model, (_, repeats), metrics = lfm2_run
    assert [r["num_cached_tokens"] for r in repeats] == [0, 0]
    assert metrics[1].get("vllm:prefix_cache_hits", 0) == 0
    assert tokens(repeats) == hf_greedy(model, REPEATS, 16)
