"""KV offload tiers on real engines: a prompt evicted from a deliberately small device pool is
served from the host tier, and after a restart from the disk tier, with the tokens of a server
without tiers; a corrupt disk file is recomputed, never served; chunked prefill and preemption
run with the tiers on; without tiers there are no external hits.

Three engines share the work: a control without tiers, one with both tiers, and a restart of it
on the same disk directory.
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import run_engine_job

pytestmark = pytest.mark.slow

BLOCK = 16
PROMPT_TOKENS = 300  # 18 full blocks
FULL_BLOCKS = PROMPT_TOKENS // BLOCK
# Tiny llama: 2 layers x K/V x 16 tokens x 2 heads x 64 x 4 bytes = 32 KiB per block. 40 blocks
# hold two of these prompts but not three: the third evicts the first, and three at once preempt.
ENGINE = {
    "kv_cache_memory_bytes": 40 * 32 * 2**10,
    "max_num_batched_tokens": 64,  # chunked prefill: five steps per prompt
    "enable_prefix_caching": True,
    "disable_log_stats": False,
}
HOST_GIB = 0.01  # 320 blocks: nothing is evicted from the host tier here
GREEDY = {"max_tokens": 8, "temperature": 0.0}

_rng = np.random.default_rng(0)
A, B, C, D, E, F = ([int(t) for t in _rng.integers(5, 700, PROMPT_TOKENS)] for _ in range(6))


def _one(prompt):
    return {"prompts": [prompt], "params": [GREEDY]}


# Three at once that fit the pool as prompts (12 blocks each) but not once each has decoded 64
# more tokens (16 blocks each): the scheduler preempts one and later resumes it.
CONCURRENT = {
    "prompts": [p[:190] for p in (D, E, F)],
    "params": [{**GREEDY, "max_tokens": 64, "ignore_eos": True}],
}
# A, two prompts that evict it from the device pool, A again, then the preempting batch; then
# sleep mode frees the device pool, and vLLM resets the prefix cache and the tiers with it (the
# weights may change meanwhile), so A, B and C are computed and stored again.
SLEEP = 5
FIRST_RUN = [
    _one(A),
    _one(B),
    _one(C),
    _one(A),
    CONCURRENT,
    {"action": "sleep_wake"},
    _one(A),
    _one(B),
    _one(C),
]


def _tokens(batch):
    return [r["outputs"][0]["token_ids"] for r in batch]


def _delta(metrics: list[dict], name: str) -> list[float]:
    values = [m.get(name, 0) for m in metrics]
    return [b - a for a, b in zip([0, *values], values)]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def control(model):
    results, metrics = run_engine_job(model, FIRST_RUN, engine=ENGINE, with_metrics="per_job")
    return results, metrics


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def tiered(model, disk_dir):
    engine = {**ENGINE, "kv_offloading_size": HOST_GIB}
    env = {"VLLM_METAL_SSD_CACHE_DIR": str(disk_dir)}
    return run_engine_job(model, FIRST_RUN, engine=engine, with_metrics="per_job", env=env)


@pytest.fixture(scope="module")
def restarted(model, disk_dir, tiered):
    """The same server started again: A and B from disk, then every file corrupted, then C."""
    engine = {**ENGINE, "kv_offloading_size": HOST_GIB}
    env = {"VLLM_METAL_SSD_CACHE_DIR": str(disk_dir)}
    jobs = [
        _one(A),
        _one(B),
        {"action": "corrupt_files", "glob": f"{disk_dir}/**/*.kvb"},
        _one(C),
    ]
    return run_engine_job(model, jobs, engine=engine, with_metrics="per_job", env=env)


def _generated(results):
    """The generate jobs' results (action jobs return dicts)."""
    return [r for r in results if isinstance(r, list)]


def test_without_tiers_an_evicted_prompt_is_recomputed(control):
    results, metrics = control
    assert results[3][0]["num_cached_tokens"] == 0  # A was evicted by B and C
    assert results[SLEEP + 1][0]["num_cached_tokens"] == 0  # and sleep mode freed the pool
    assert sum(_delta(metrics, "vllm:external_prefix_cache_hits")) == 0
    assert not [name for name in metrics[-1] if "kv_offload" in name]


def test_the_host_tier_serves_the_evicted_prompt(control, tiered):
    results, metrics = tiered
    expected, _ = control
    assert [_tokens(b) for b in _generated(results)] == [_tokens(b) for b in _generated(expected)]
    assert results[3][0]["num_cached_tokens"] == FULL_BLOCKS * BLOCK
    assert _delta(metrics, "vllm:kv_offload_host_hit_blocks")[3] == FULL_BLOCKS
    # After sleep mode: nothing cached, and the blocks are stored again from the new pool.
    assert results[SLEEP + 1][0]["num_cached_tokens"] == 0
    assert _delta(metrics, "vllm:kv_offload_store_bytes")[SLEEP] == FULL_BLOCKS * 32 * 2**10
    assert _delta(metrics, "vllm:external_prefix_cache_hits")[3] == FULL_BLOCKS * BLOCK
    assert sum(_delta(metrics, "vllm:kv_offload_disk_hit_blocks")) == 0
    assert _delta(metrics, "vllm:kv_offload_store_bytes")[0] == FULL_BLOCKS * 32 * 2**10
    # The concurrent batch did not fit the device pool together.
    assert _delta(metrics, "vllm:num_preemptions")[4] > 0


def test_after_a_restart_the_disk_tier_serves_the_prompts(control, tiered, restarted, disk_dir):
    results, metrics = restarted
    expected, _ = control
    assert _tokens(results[0]) == _tokens(expected[0])  # A
    assert _tokens(results[1]) == _tokens(expected[1])  # B
    assert [r["num_cached_tokens"] for r in (results[0][0], results[1][0])] == [
        FULL_BLOCKS * BLOCK
    ] * 2
    disk_hits = _delta(metrics, "vllm:kv_offload_disk_hit_blocks")
    assert disk_hits[:2] == [FULL_BLOCKS, FULL_BLOCKS]
    assert sum(_delta(metrics, "vllm:kv_offload_host_hit_blocks")) == 0


def test_a_corrupt_disk_file_is_recomputed_never_served(control, restarted, disk_dir):
    results, metrics = restarted
    expected, _ = control
    # The blocks of A, B and C written through after the sleep: the reset deleted the earlier
    # files (the concurrent prompts' among them).
    assert results[2]["corrupted"] == 3 * FULL_BLOCKS
    c = results[3][0]
    assert c["outputs"][0]["token_ids"] == _tokens(expected[2])[0]
    # The files were found (a disk hit was tried) but failed their checksum: nothing cached.
    assert c["num_cached_tokens"] == 0
    assert _delta(metrics, "vllm:kv_offload_disk_hit_blocks")[2] > 0
    left = glob.glob(f"{disk_dir}/**/*.kvb", recursive=True)
    assert len(left) < results[2]["corrupted"]  # the corrupt files C touched were deleted


@pytest.mark.full
def test_a_sliding_window_model_is_served_from_the_host_tier(tiny_model_dir):
    """Gemma 3's sliding and full layers are two KV-cache groups: both are offloaded and loaded
    (the sliding group only its window's blocks)."""
    model = tiny_model_dir("gemma3")
    # One region of 16 KiB pages here; 44 blocks hold two prompts (max_model_len 320).
    engine = {**ENGINE, "kv_cache_memory_bytes": 44 * 16 * 2**10, "max_model_len": 320}
    jobs = FIRST_RUN[:4]
    expected, _ = run_engine_job(model, jobs, engine=engine, with_metrics="per_job")
    engine["kv_offloading_size"] = HOST_GIB
    results, metrics = run_engine_job(model, jobs, engine=engine, with_metrics="per_job")
    assert [_tokens(b) for b in results] == [_tokens(b) for b in expected]
    assert expected[3][0]["num_cached_tokens"] == 0
    assert results[3][0]["num_cached_tokens"] == FULL_BLOCKS * BLOCK
    # 18 blocks of the full-attention group, and the window's blocks of the sliding group.
    assert _delta(metrics, "vllm:kv_offload_host_hit_blocks")[3] > FULL_BLOCKS
