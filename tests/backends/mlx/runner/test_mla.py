"""Multi-head latent attention (MLA) models served by the MLX runner: GLM-4.7-Flash (in CI), and
DeepSeek-V3, DeepSeek-V2 (V2-Lite's shape without a query LoRA, and one with a query LoRA and
group-limited routing), MiniCPM3 and Kimi K2 (`full`; the same runner path at other sizes,
DeepSeek-V2 and MiniCPM3 with `kv_b_proj` split at load, Kimi K2 as DeepSeek-V3 under its own
model_type), whose layers cache one latent row per token (`kv.latent`) and
attend in the absorbed form. Greedy tokens and
logprobs equal transformers float32 (which expands the latent into per-head keys and values) for a
mixed batch prefilled in chunks smaller than its prompts, from a KV pool so small that vLLM
preempts requests; then two prompts sharing a prefix, one job after the other: the second is
served from vLLM's prefix cache and still equals transformers (a cache-on round whose results
equal the cache-free oracle). GLM-4.7-Flash's engine runs its decode steps compiled
(`runner/compiled.py`, the default on a Mac's GPU), the others eagerly (the CPU's default)."""

from __future__ import annotations

import json
from pathlib import Path

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
BLOCK_SIZE = 16
# A latent row is 64 + 16 float32 values in every tiny checkpoint; 3 layers: 960 bytes a token.
TOKEN_BYTES = 3 * (64 + 16) * 4
# Engines with compiled decode steps (in-process, so the runner's count of them can be read).
COMPILED = {"glm4_moe_lite"}


@pytest.fixture(
    scope="module",
    params=[
        "glm4_moe_lite",
        *(
            pytest.param(name, marks=pytest.mark.full)
            for name in (
                "deepseek_v3",
                "deepseek_v2_lite",
                "deepseek_v2_grouped",
                "minicpm3",
                "kimi_k2",
            )
        ),
    ],
)
def mla_model(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


@pytest.fixture(scope="module")
def tiny_kimi_k2_dir(tiny_deepseek_v3_dir, tmp_path_factory):
    """Kimi K2 as its checkpoints are: DeepSeek-V3's architecture under model_type `kimi_k2`
    (which vLLM reads with DeepSeek-V3's config class and mlx-lm remaps to deepseek_v3); the
    tiny DeepSeek-V3's files with that model_type. transformers knows no `kimi_k2`, so its oracle
    is the DeepSeek-V3 checkpoint itself (`_oracle`)."""
    import shutil

    root = tmp_path_factory.mktemp("tiny-kimi-k2")
    path = root / "kimi_k2"
    shutil.copytree(tiny_deepseek_v3_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (path / "config.json").write_text(json.dumps(config))
    (root / "oracle").symlink_to(tiny_deepseek_v3_dir)
    return path


def _oracle(model: Path) -> Path:
    """The checkpoint transformers runs for `model`: itself, or Kimi K2's DeepSeek-V3 twin."""
    twin = model.parent / "oracle"
    return twin if model.name == "kimi_k2" and twin.exists() else model


@pytest.fixture(scope="module")
def mla_run(mla_model):
    prompts = random_prompts(21, [30, 26, 35, 1, 5])
    # 32 tokens (two whole blocks) and two tails.
    prefix = random_prompts(23, [32])[0]
    shared = [prefix + tail for tail in random_prompts(22, [7, 12])]
    engine = {
        "max_num_batched_tokens": 16,
        "block_size": BLOCK_SIZE,
        # 8 blocks (7 usable: 112 tokens): the batch needs 16 at its longest, so requests are
        # preempted.
        "kv_cache_memory_bytes": 8 * BLOCK_SIZE * TOKEN_BYTES,
        "max_model_len": 96,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        *({"prompts": [prompt], "params": [greedy(NEW_TOKENS)]} for prompt in shared),
    ]
    compiled = mla_model.name in COMPILED
    if compiled:
        jobs.append({"action": "compiled_steps"})
    results, metrics = run_engine_job(
        mla_model,
        jobs,
        engine=engine,
        with_metrics="per_job",
        env=COMPILED_ENV if compiled else None,
    )
    return prompts, shared, results, metrics


@pytest.mark.slow
def test_mla_greedy_matches_transformers_through_chunks_and_preemption(mla_model, mla_run):
    from tests.fixtures.oracles import hf_greedy

    prompts, _, (batch, *_), metrics = mla_run
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    assert tokens(batch) == hf_greedy(_oracle(mla_model), prompts, NEW_TOKENS)
    assert_logprobs_match_hf(_oracle(mla_model), prompts, batch)


@pytest.mark.slow
def test_mla_prefix_cache_hits_match_transformers(mla_model, mla_run):
    from tests.fixtures.oracles import hf_greedy

    _, shared, (_, first, second, *_), _ = mla_run
    assert second[0]["num_cached_tokens"] == 2 * BLOCK_SIZE, second[0]["num_cached_tokens"]
    assert tokens(first + second) == hf_greedy(_oracle(mla_model), shared, NEW_TOKENS)


@pytest.mark.slow
def test_mla_decode_steps_compiled(mla_model, mla_run):
    """The compiled engine's tokens above come from compiled decode steps (decode steps of
    this schedule: the batch's and both prefix rounds' most steps)."""
    if mla_model.name not in COMPILED:
        pytest.skip("an eager engine")
    *_, results, _ = mla_run
    assert results[-1] >= 2 * NEW_TOKENS, results[-1]
