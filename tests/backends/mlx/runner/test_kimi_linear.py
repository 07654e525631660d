"""Kimi-Linear served by the MLX runner: Kimi Delta Attention layers (state pages, a per-channel
decay) between multi-head latent attention layers without rotary embeddings (the paged latent
cache), the state pages living in the latent cache's regions. One engine with prefix caching on
(vLLM's "align" mamba cache mode) and one without ("none": one state page per request): a mixed
batch prefilled in chunks smaller than its prompts, from a KV pool so small that vLLM preempts
requests, then two prompts sharing a two-block prefix, one job after the other, the second
served from the prefix cache where it is on. Greedy tokens and logprobs equal transformers
float32 (which runs the same layers with dense caches)."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)

NEW_TOKENS = 24
# The block size the platform picks so that a block holds a state page (`kv.state`): the tiny
# checkpoint's page is 2 heads x 64 x 64 float32 + a 3 x 384 float32 window = 37,376 bytes, and
# an MLA token is one latent row of 64 + 16 float32 values (320 bytes): 117 -> 128 tokens.
BLOCK_SIZE = 128
# Per block id, the two layers of a KV-cache group (vLLM groups the two MLA layers and the two
# KDA layers).
BLOCK_BYTES = 2 * BLOCK_SIZE * 320

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module", params=[True, False], ids=["align", "none"])
def kimi_run(request, tiny_kimi_linear_dir):
    long = [BLOCK_SIZE - 10, BLOCK_SIZE - 14, BLOCK_SIZE - 5, BLOCK_SIZE - 20]
    prompts = random_prompts(21, [*long, 1, 5])
    prefix = random_prompts(23, [2 * BLOCK_SIZE])[0]
    shared = [prefix + tail for tail in random_prompts(22, [7, 12])]
    engine = {
        "enable_prefix_caching": request.param,
        "max_num_batched_tokens": 16,
        "kv_cache_memory_bytes": 9 * BLOCK_BYTES,
        "max_model_len": 2 * BLOCK_SIZE + 48,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        *({"prompts": [prompt], "params": [greedy(NEW_TOKENS)]} for prompt in shared),
    ]
    results, metrics = run_engine_job(
        tiny_kimi_linear_dir, jobs, engine=engine, with_metrics="per_job"
    )
    return request.param, prompts, shared, results, metrics


def test_kimi_linear_greedy_matches_transformers_through_chunks_and_preemption(
    tiny_kimi_linear_dir, kimi_run
):
    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.tiny_kimi_linear import use_transformers_config

    use_transformers_config()  # where this process read the config through vLLM before

    _, prompts, _, (batch, *_), metrics = kimi_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(batch) == hf_greedy(tiny_kimi_linear_dir, prompts, NEW_TOKENS)
    assert_logprobs_match_hf(tiny_kimi_linear_dir, prompts, batch)


def test_kimi_linear_prefix_cache_hits_match_transformers(tiny_kimi_linear_dir, kimi_run):
    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.tiny_kimi_linear import use_transformers_config

    use_transformers_config()  # where this process read the config through vLLM before

    caching, _, shared, (_, first, second), _ = kimi_run
    cached = second[0]["num_cached_tokens"]
    assert cached == (2 * BLOCK_SIZE if caching else 0), cached
    assert tokens(first + second) == hf_greedy(tiny_kimi_linear_dir, shared, NEW_TOKENS)
