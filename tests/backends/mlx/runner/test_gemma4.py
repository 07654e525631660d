"""Gemma 4 text served by the MLX runner: the E2B/E4B-like tiny checkpoint (in CI: sliding and
full-attention layers with their own head sizes and KV heads in their own KV-cache groups with
different tokens per block, two layers attending over earlier layers' K/V, per-layer input
embeddings) and the 26B-A4B-like MoE one (`full`: experts beside the MLP, full layers whose values
are their keys). Greedy tokens and logprobs equal transformers float32 for a mixed batch
prefilled in chunks smaller than its prompts and longer than the sliding window, from a KV pool so
small that vLLM preempts requests; then two prompts sharing a prefix, one job after the other: the
second is served from vLLM's prefix cache and still equals transformers; then one request of the
whole context, which fits the pool only because the sliding layers hold no more than their
window (`LONG_PROMPT`)."""

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
BLOCK_SIZE = 16
# vLLM's page: the full layer's 16 tokens x 2 KV heads x 64 x (K, V) x float32 in both tiny
# checkpoints (the sliding layers' 32 tokens x 2 x 32 in the dense one fill the same page).
PAGE_BYTES = BLOCK_SIZE * 2 * 64 * 2 * 4
# How far a sampled token's logprob may be from transformers'. The MoE checkpoint's activations
# grow fast through its layers (both of its feed-forward branches land on Gemma's loud
# post-norms), and float32 rounding with them: mlx-lm's own forward is 2e-3 off transformers' in
# its logits there, 3e-4 in the dense one's.
LOGPROB_TOL = {"dense": 1e-3, "moe": 5e-3}
MAX_MODEL_LEN = 96
POOL_PAGES = 24
# A request of the whole context (72 + 24 tokens). Had every layer of the dense checkpoint kept its
# whole context, it would
# hold 96 / 16 = 6 pages in each of the 4 KV-cache groups (one a layer with KV memory, as vLLM
# groups 3 sliding layers and 1 full one), all 24 pages of the pool, which also keeps one null
# page: only the sliding layers' dropping the pages that left their window lets vLLM start the
# engine at this context length and serve it.
LONG_PROMPT = MAX_MODEL_LEN - NEW_TOKENS


@pytest.fixture(scope="module", params=["dense", pytest.param("moe", marks=pytest.mark.full)])
def gemma4_variant(request):
    return request.param


@pytest.fixture(scope="module")
def gemma4_model(request, gemma4_variant):
    return request.getfixturevalue(
        "tiny_gemma4_dir" if gemma4_variant == "dense" else "tiny_gemma4_moe_dir"
    )


@pytest.fixture(scope="module")
def gemma4_run(gemma4_model):
    prompts = random_prompts(31, [30, 26, 35, 1, 5])
    # 32 tokens (two whole blocks of the full layers' group) and two tails.
    prefix = random_prompts(33, [32])[0]
    shared = [prefix + tail for tail in random_prompts(32, [7, 12])]
    engine = {
        "max_num_batched_tokens": 16,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": POOL_PAGES * PAGE_BYTES,
        "max_model_len": MAX_MODEL_LEN,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        *({"prompts": [prompt], "params": [greedy(NEW_TOKENS)]} for prompt in shared),
        {"prompts": random_prompts(34, [LONG_PROMPT]), "params": [greedy(NEW_TOKENS)]},
    ]
    results, metrics = run_engine_job(gemma4_model, jobs, engine=engine, with_metrics="per_job")
    return prompts, shared, results, metrics


@pytest.mark.slow
def test_gemma4_greedy_matches_transformers_through_chunks_and_preemption(
    gemma4_variant, gemma4_model, gemma4_run
):
    from tests.fixtures.oracles import hf_greedy

    prompts, _, (batch, *_), metrics = gemma4_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(batch) == hf_greedy(gemma4_model, prompts, NEW_TOKENS)
    assert_logprobs_match_hf(gemma4_model, prompts, batch, tol=LOGPROB_TOL[gemma4_variant])


@pytest.mark.slow
def test_gemma4_prefix_cache_hits_match_transformers(gemma4_model, gemma4_run):
    from tests.fixtures.oracles import hf_greedy

    _, shared, (_, first, second, _), _ = gemma4_run
    assert second[0]["num_cached_tokens"] >= 2 * BLOCK_SIZE, second[0]["num_cached_tokens"]
    assert tokens(first + second) == hf_greedy(gemma4_model, shared, NEW_TOKENS)


@pytest.mark.slow
def test_gemma4_serves_a_whole_context_request_its_sliding_layers_make_room_for(
    gemma4_model, gemma4_run
):
    from tests.fixtures.oracles import hf_greedy

    *_, (long,) = gemma4_run[2]
    prompt = random_prompts(34, [LONG_PROMPT])
    assert tokens([long]) == hf_greedy(gemma4_model, prompt, NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize(("variant", "bits"), [("dense", 4), ("moe", 8)])
def test_mlx_quantized_gemma4_matches_mlx_lm(tmp_path, variant, bits):
    """A 4-bit dense and an 8-bit MoE Gemma 4, quantized by mlx-lm's converter from a checkpoint
    in the published layout (`global_head_dim`, which the converter's loader needs), give stock
    mlx-lm's greedy tokens."""
    import json

    from tests.fixtures.oracles import mlx_lm_greedy
    from tests.fixtures.tiny_gemma4 import GLOBAL_HEAD_DIM, write_tiny_gemma4
    from vllm_metal.testing.tiny_models import quantize_tiny_model

    src = write_tiny_gemma4(tmp_path / variant, variant, dtype="bfloat16")
    config = json.loads((src / "config.json").read_text())
    config["global_head_dim"] = GLOBAL_HEAD_DIM
    if variant == "moe":
        config["num_global_key_value_heads"] = 1
    (src / "config.json").write_text(json.dumps(config))
    model = quantize_tiny_model(src, tmp_path / f"{variant}-q{bits}", bits=bits, group_size=64)
    assert json.loads((model / "config.json").read_text())["quantization"]["bits"] == bits
    prompts = random_prompts(35, [30, 9, 17])
    (batch,) = run_engine_job(model, [{"prompts": prompts, "params": [greedy(16)]}])
    assert tokens(batch) == mlx_lm_greedy(model, prompts, 16, dtype="float32")
