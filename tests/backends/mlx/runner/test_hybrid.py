"""Hybrid models served by the MLX runner: Qwen3-Next (Gated DeltaNet layers, three to each
full-attention layer) and Granite 4.0-H (Mamba-2 layers around an attention layer), both with MoE
blocks. Greedy tokens and logprobs equal transformers float32 for a mixed batch whose prompts are
prefilled in chunks smaller than themselves (the recurrent state and convolution window carried
across steps in the state pages), from a KV pool so small that vLLM preempts requests (a
preempted request restarts from a zero state and recomputes)."""

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
# Attention block size the platform picks so that a block holds a state page (`kv.state`):
# Qwen3-Next's page is 35,840 bytes, Granite's 19,456; an attention token is 512 bytes.
BLOCK_SIZE = {"qwen3_next": 80, "granitemoehybrid": 48}


def _mixed(block_size: int) -> list[list[int]]:
    """Prompts of several 16-token chunks that cross a block while decoding, then a single-token
    and a shorter-than-a-chunk one (FCFS: the long ones run first)."""
    long = [block_size - 10, block_size - 14, block_size - 5, block_size - 20]
    return random_prompts(21, [*long, 1, 5])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "granitemoehybrid"])
def test_hybrid_greedy_matches_transformers_through_chunks_and_preemption(request, family):
    from tests.fixtures.oracles import hf_greedy

    model = request.getfixturevalue(f"tiny_{family}_dir")
    block_size = BLOCK_SIZE[family]
    prompts = _mixed(block_size)
    engine = {
        "max_num_batched_tokens": 16,
        # 13 blocks: three requests run (3 state blocks + 1 attention block each) and cannot all
        # take their second attention block.
        "kv_cache_memory_bytes": 13 * block_size * 512,
        "max_model_len": 256,
        "disable_log_stats": False,
    }
    jobs = [{"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]}]
    (batch,), counters = run_engine_job(model, jobs, engine=engine, with_metrics=True)

    assert counters.get("vllm:num_preemptions", 0) >= 1, sorted(counters.items())
    assert tokens(batch) == hf_greedy(model, prompts, NEW_TOKENS)
    assert_logprobs_match_hf(model, prompts, batch)
