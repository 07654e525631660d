"""A Gated DeltaNet hybrid (Qwen3-Next: three linear-attention layers to one full-attention
layer, MoE blocks) served by the MLX runner: greedy tokens and logprobs equal transformers
float32 for a mixed batch whose prompts are prefilled in chunks smaller than themselves (the
recurrent state and convolution window carried across steps in the state pages), from a KV pool
so small that vLLM preempts requests (a preempted request restarts from a zero state and
recomputes)."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens

NEW_TOKENS = 24
# Prompts of several chunks that cross an 80-token block while decoding, then a single-token and
# a shorter-than-a-chunk one.
MIXED = random_prompts(21, [70, 66, 75, 60, 1, 5])
# A block holds one state page (40,960 bytes, `kv.state`); in 13 blocks three requests run
# (3 state blocks + 1 attention block each) and cannot all take their second attention block.
TIGHT_POOL = 13 * 80 * 512


@pytest.mark.slow
def test_qwen3_next_greedy_matches_transformers_through_chunks_and_preemption(
    tiny_qwen3_next_dir,
):
    from vllm_metal.testing.oracles import hf_greedy, hf_logprobs

    model = tiny_qwen3_next_dir
    engine = {
        "max_num_batched_tokens": 16,
        "kv_cache_memory_bytes": TIGHT_POOL,
        "max_model_len": 256,
        "disable_log_stats": False,
    }
    jobs = [{"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1)]}]
    (batch,), counters = run_engine_job(model, jobs, engine=engine, with_metrics=True)

    assert counters.get("vllm:num_preemptions", 0) >= 1, sorted(counters.items())
    assert tokens(batch) == hf_greedy(model, MIXED, NEW_TOKENS)
    for prompt, result in zip(MIXED, batch):
        sample = result["outputs"][0]
        ref = hf_logprobs(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            got = sample["logprobs"][step][str(token)]
            want = ref[len(prompt) - 1 + step, token]
            assert abs(got - want) < 1e-3, (step, got, want)
