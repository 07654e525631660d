"""Hybrid models served by the MLX runner: Qwen3-Next (Gated DeltaNet layers, three to each
full-attention layer), Qwen3.5 (the same layer mix; dense and MoE, in the published wrapper layout
and as the text-only `Qwen3_5ForCausalLM`) and Granite 4.0-H (Mamba-2 layers around an attention
layer), Nemotron-H (Mamba-2, attention, MLP-only and MoE-only blocks) and Falcon-H1 (a Mamba-2
mixer beside attention in every layer: two memory layers per decoder layer). Greedy tokens and
logprobs equal transformers float32 for a mixed batch whose prompts are
prefilled in chunks smaller than themselves (16 tokens; 32 for Qwen3.5; the recurrent state and
convolution window carried across steps in the state pages), from a KV pool so small that vLLM
preempts requests (a preempted request restarts from a zero state and recomputes). MLX-quantized
Qwen3.5 checkpoints (4-bit dense, 8-bit MoE) give stock mlx-lm's greedy tokens."""

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
# Attention block size the platform picks so that a block holds a state page (`kv.state`):
# Qwen3-Next's (and the tiny Qwen3.5's) page is 35,840 bytes, Granite's 19,456, Nemotron-H's and
# Falcon-H1's 10,496; an attention token is 512 bytes.
BLOCK_SIZE = {
    "qwen3_next": 80,
    "granitemoehybrid": 48,
    "qwen3_5": 80,
    "nemotron_h": 32,
    "falcon_h1": 32,
}
# KV tensors vLLM allocates per block id (the layers of its largest group): one for the families
# whose state layers outnumber their attention layers, one per layer for Falcon-H1, whose
# attention and Mamba-2 groups are the same size.
TENSORS = {"falcon_h1": 2}
# Prefill chunk (max_num_batched_tokens) per family.
CHUNK = {"qwen3_5": 32}
# The checkpoint fixture of each case, and its family.
CASES = {
    "qwen3_next": "qwen3_next",
    "granitemoehybrid": "granitemoehybrid",
    "qwen3_5": "qwen3_5",
    "qwen3_5_causal_lm": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "nemotron_h": "nemotron_h",
    "falcon_h1": "falcon_h1",
}
# Cases whose engines run their decode steps compiled (`runner/compiled.py`, the default on a
# Mac's GPU; in-process, so the runner's count of them can be read); the others eagerly.
COMPILED = {"qwen3_5", "granitemoehybrid", "qwen3_5_moe", "falcon_h1"}


def _mixed(block_size: int) -> list[list[int]]:
    """Prompts of several chunks that cross a block while decoding, then a single-token
    and a shorter-than-a-chunk one (FCFS: the long ones run first)."""
    long = [block_size - 10, block_size - 14, block_size - 5, block_size - 20]
    return random_prompts(21, [*long, 1, 5])


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        "qwen3_next",
        "granitemoehybrid",
        "qwen3_5",
        # Loading alone differs from the wrapper: tests/models/test_qwen3_5.py checks it in CI.
        pytest.param("qwen3_5_causal_lm", marks=pytest.mark.full),
        pytest.param("qwen3_5_moe", marks=pytest.mark.full),
        pytest.param("nemotron_h", marks=pytest.mark.full),
        pytest.param("falcon_h1", marks=pytest.mark.full),
    ],
)
def test_hybrid_greedy_matches_transformers_through_chunks_and_preemption(request, case):
    from tests.fixtures.oracles import hf_greedy

    model = request.getfixturevalue(f"tiny_{case}_dir")
    family = CASES[case]
    block_size = BLOCK_SIZE[family]
    prompts = _mixed(block_size)
    engine = {
        "max_num_batched_tokens": CHUNK.get(family, 16),
        # 13 blocks: three requests run (3 state blocks + 1 attention block each) and cannot all
        # take their second attention block.
        "kv_cache_memory_bytes": 13 * block_size * 512 * TENSORS.get(family, 1),
        "max_model_len": 256,
        "disable_log_stats": False,
    }
    jobs = [{"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]}]
    compiled = case in COMPILED
    if compiled:
        jobs.append({"action": "compiled_steps"})
    (batch, *compiled_steps), counters = run_engine_job(
        model, jobs, engine=engine, with_metrics=True, env=COMPILED_ENV if compiled else None
    )

    if compiled:  # most of the schedule's decode steps
        assert compiled_steps[0] >= NEW_TOKENS, compiled_steps
    assert counters.get("vllm:num_preemptions", 0) >= 1, sorted(counters.items())
    assert tokens(batch) == hf_greedy(model, prompts, NEW_TOKENS)
    assert_logprobs_match_hf(model, prompts, batch)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize(("layout", "bits"), [("wrapper", 4), ("moe_wrapper", 8)])
def test_mlx_quantized_qwen3_5_matches_mlx_lm(tiny_qwen3_5_dirs, tmp_path, layout, bits):
    """A 4-bit dense (mlx-lm's converter) and an 8-bit MoE Qwen3.5 (quantized as the converter
    does, `quantize_tiny_qwen3_5`) give stock mlx-lm's greedy tokens."""
    import json

    from tests.fixtures.oracles import mlx_lm_greedy
    from tests.fixtures.tiny_qwen3_5 import quantize_tiny_qwen3_5
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    src = tiny_qwen3_5_dirs(layout, "bfloat16")
    dst = tmp_path / f"{layout}-q{bits}"
    if layout == "wrapper":
        model = quantize_tiny_model(src, dst, bits=bits, group_size=64)
    else:
        model = quantize_tiny_qwen3_5(src, dst, bits=bits, group_size=64)
    assert json.loads((model / "config.json").read_text())["quantization"]["bits"] == bits
    prompts = _mixed(BLOCK_SIZE["qwen3_5"])[1:4]
    (batch,) = run_engine_job(model, [{"prompts": prompts, "params": [greedy(16)]}])
    assert tokens(batch) == mlx_lm_greedy(model, prompts, 16, dtype="float32")
