"""Pipeline parallelism with vLLM's multiprocessing executor: two MLX workers, each loading only
its decoder layers and its own KV pool, hand hidden states on as `IntermediateTensors`; the last
samples. Greedy tokens and prompt logprobs equal transformers float32 (one process is held to
the same in tests/backends/test_parity.py) for every model type a stage serves
(`PIPELINE_STAGE_TYPES`) through a mixed batch with 16-token prefill chunks, a
prefix-cache round and preemption.

The same stages through vLLM's Ray executor and a local Ray cluster (the `ray` extra), through the
same rounds, run in the `full` tier.

Cost: one two-stage engine (Qwen3 in CI), about 40 s of one CI worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from bench.harness.servers import free_port
from tests.backends.mlx.runner.jobs import (
    REPO_ROOT,
    greedy,
    kv_block_bytes,
    run_engine_job,
    tokens,
)
from tests.backends.test_parity import (
    MIXED,
    NEW_TOKENS,
    POOL_BLOCKS,
    PREEMPTED,
    PREFIX_HITS,
    PROMPT_LOGPROB_PROMPTS,
    SHARED_PREFIX,
    assert_prompt_logprobs_match_hf,
)
from tests.fixtures.oracles import hf_greedy

pytestmark = pytest.mark.slow


def _stage_weight_bytes(model: Path, layers: range) -> int:
    """Bytes of the checkpoint's tensors a stage running `layers` holds: everything but the other
    stages' decoder layers."""
    total = 0
    with safe_open(str(model / "model.safetensors"), "np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) not in layers:
                continue
            total += f.get_tensor(name).nbytes
    return total


@pytest.fixture
def three_layers(tiny_model_dir, tmp_path):
    """Factory: a 3-layer tiny checkpoint of `arch` (an uneven split: stages of 2 and 1 layers)."""

    def make(arch: str) -> Path:
        if arch in ("qwen3_moe", "mixtral"):
            from tests.fixtures.tiny_moe import write_tiny_moe

            return write_tiny_moe(tmp_path / arch, arch, num_layers=3)
        return tiny_model_dir(arch, num_layers=3)

    return make


# Every model type a stage serves; CI runs the first.
STAGE_ARCHS = ("qwen3", "llama", "qwen2", "qwen3_moe", "mixtral")


def _rounds(model: Path, engine: dict, env: dict | None = None) -> None:
    """The engine (two stages of `model`) through the rounds one process is held to: a mixed
    batch in 16-token prefill chunks, a prefix-cache round, preemption and prompt logprobs give
    transformers' tokens and logprobs; each stage holds only its own layers' weights."""
    engine = {
        "pipeline_parallel_size": 2,
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        # Every stage gets these bytes; the two-layer stage fits POOL_BLOCKS blocks of its
        # layers in them and vLLM plans the smallest count for all, so five 96-token sequences
        # preempt as in one process.
        "kv_cache_memory_bytes": POOL_BLOCKS * kv_block_bytes(model) * 2 // 3,
        "max_model_len": 256,
        "disable_log_stats": False,
        **engine,
    }
    jobs = [
        {"action": "memory_usage"},
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS)]},
        {"prompts": [SHARED_PREFIX + [5]], "params": [greedy(4)]},
        {"prompts": PREFIX_HITS, "params": [greedy(NEW_TOKENS)]},
        {"prompts": PREEMPTED, "params": [greedy(48)]},
        {"prompts": PROMPT_LOGPROB_PROMPTS, "params": [greedy(2, prompt_logprobs=2)]},
    ]
    (memory, mixed, _, hits, preempted, prompt_lp), metrics = run_engine_job(
        model, jobs, engine=engine, env=env, with_metrics=True
    )

    assert tokens(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens(hits) == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    assert all(r["num_cached_tokens"] >= 32 for r in hits), [r["num_cached_tokens"] for r in hits]
    assert tokens(preempted) == hf_greedy(model, PREEMPTED, 48)
    assert metrics.get("vllm:num_preemptions", 0) > 0, metrics
    for prompt, result in zip(PROMPT_LOGPROB_PROMPTS, prompt_lp):
        assert_prompt_logprobs_match_hf(model, prompt, result["prompt_logprobs"])
    # vLLM's split of 3 layers over 2 stages: each stage holds only its own layers' weights.
    assert [m["weights"] for m in memory] == [
        _stage_weight_bytes(model, range(2)),
        _stage_weight_bytes(model, range(2, 3)),
    ]


@pytest.mark.parametrize(
    "arch",
    [STAGE_ARCHS[0], *(pytest.param(a, marks=pytest.mark.full) for a in STAGE_ARCHS[1:])],
)
def test_two_stages_give_one_process_greedy_tokens(three_layers, arch):
    model = three_layers(arch)
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 3
    _rounds(model, {})


@pytest.fixture
def ray_cluster(tmp_path):
    """A local Ray cluster started the usual way (`ray start`), declaring two GPUs (the two
    stages' devices); its address. Skipped where the `ray` extra is not installed."""
    pytest.importorskip("ray")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    subprocess.run(
        [*ray, "start", "--head", "--port", str(port), "--num-gpus", "2", "--num-cpus", "2",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([*ray, "stop"], env=env, check=False, capture_output=True, timeout=120)


def test_every_stage_type_is_tested():
    from vllm_metal.models.families import PIPELINE_STAGE_TYPES

    assert sorted(PIPELINE_STAGE_TYPES) == sorted(STAGE_ARCHS)


@pytest.mark.full
def test_two_stages_through_a_ray_cluster_give_one_process_greedy_tokens(ray_cluster, three_layers):
    _rounds(
        three_layers("qwen3"),
        {"distributed_executor_backend": "ray"},
        env={"RAY_ADDRESS": ray_cluster},
    )
