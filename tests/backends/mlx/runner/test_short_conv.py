"""LFM2 (gated short-convolution layers between attention layers) served by the MLX runner: the
convolution's window carried in the requests' state pages (a state with no recurrent part),
continued across 16-token prefill chunks, restarted after a preemption and restored from a
prefix hit (vLLM's "align" mode: the window after a block's last token stays in that block's
page). Greedy tokens and logprobs equal transformers float32 for a mixed batch from a pool so
small that vLLM preempts requests; then two prompts sharing a prefix that ends mid-block, one job
after the other: the second is served from the prefix cache (two blocks) and still equals
transformers. The engine runs its decode steps compiled (`runner/compiled.py`: the windows'
pages read and written by block ids that are inputs of the trace)."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    COMPILED_ENV,
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)

NEW_TOKENS = 24
# The platform keeps the block size at 16: a window (2 x 256 float32 values) fits in an attention
# block (16 tokens x 2 KV heads x 64 x K and V x float32 = 16 KiB), which is vLLM's page.
BLOCK_SIZE = 16
PAGE_BYTES = BLOCK_SIZE * 2 * 64 * 2 * 4


@pytest.fixture(scope="module")
def lfm2_run(tiny_lfm2_dir):
    prompts = random_prompts(51, [30, 26, 35, 1, 5])
    prefix = random_prompts(53, [2 * BLOCK_SIZE + 5])[0]  # ends mid-block
    shared = [prefix + tail for tail in random_prompts(52, [7, 12])]
    engine = {
        "max_num_batched_tokens": 16,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": 16 * PAGE_BYTES,
        "max_model_len": 96,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        *({"prompts": [prompt], "params": [greedy(NEW_TOKENS)]} for prompt in shared),
        {"action": "compiled_steps"},
    ]
    results, metrics = run_engine_job(
        tiny_lfm2_dir, jobs, engine=engine, with_metrics="per_job", env=COMPILED_ENV
    )
    return prompts, shared, results, metrics


@pytest.mark.slow
def test_lfm2_greedy_matches_transformers_through_chunks_and_preemption(tiny_lfm2_dir, lfm2_run):
    from tests.fixtures.oracles import hf_greedy

    prompts, _, (batch, *_), metrics = lfm2_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(batch) == hf_greedy(tiny_lfm2_dir, prompts, NEW_TOKENS)
    assert_logprobs_match_hf(tiny_lfm2_dir, prompts, batch)


@pytest.mark.slow
def test_lfm2_prefix_hits_restore_the_window(tiny_lfm2_dir, lfm2_run):
    from tests.fixtures.oracles import hf_greedy

    _, shared, (_, first, second, compiled_steps), _ = lfm2_run
    assert second[0]["num_cached_tokens"] == 2 * BLOCK_SIZE, second[0]["num_cached_tokens"]
    assert tokens(first + second) == hf_greedy(tiny_lfm2_dir, shared, NEW_TOKENS)
    assert compiled_steps >= 2 * NEW_TOKENS, compiled_steps  # the decode steps above
