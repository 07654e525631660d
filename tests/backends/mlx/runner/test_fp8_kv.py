"""An fp8 KV cache (--kv-cache-dtype fp8) computes what transformers float32 computes over keys and
values stored as fp8 (a float64 quantize -> dequantize oracle), through chunked prefill, preemption
and prefix-cache hits that read the stored bytes back; its distance from the unquantized cache is
measured (and, in the full tier, compared with vLLM's CPU backend on the same setting)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    greedy,
    kv_block_bytes,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.fp8_reference import hf_fp8_kv_logprobs
from tests.fixtures.oracles import hf_greedy, hf_logprobs

pytestmark = pytest.mark.slow

PROMPTS = random_prompts(43, [5, 17, 40, 64, 23, 90, 9, 33])
MAX_TOKENS = 24
# Each sampled token's logprob against the fp8 oracle (float32 model, float64 quantizer): what an
# exact fp8 cache gives, so only accumulation order differs (measured max 1.4e-4 for e4m3).
ORACLE_TOL = 2e-3
# Against the unquantized cache the cost is the format's own: the agreement and |logprob error|
# measured on this checkpoint (float32 model, 192 teacher-forced positions), the plugin's and vLLM's
# CPU backend's with the same setting, are in docs/kv-cache.md ("Accuracy cost"). The bounds below
# sit under them; a wrong dequantization is whole nats off.
MIN_AGREEMENT = {"fp8_e4m3": 0.85, "fp8_e5m2": 0.75}
MAX_MEAN_ERROR = {"fp8_e4m3": 0.2, "fp8_e5m2": 0.4}


def _logprob_rows(model, batch, oracle) -> tuple[np.ndarray, list[bool]]:
    """|engine - oracle| of each sampled token's logprob, and whether each token is the oracle's
    greedy choice (up to a near-tie)."""
    errors, greedy_ok = [], []
    for prompt, result in zip(PROMPTS, batch):
        sample = result["outputs"][0]
        toks = sample["token_ids"]
        ref = oracle(model, prompt + toks)
        for step, token in enumerate(toks):
            row = ref[len(prompt) - 1 + step]
            errors.append(abs(sample["logprobs"][step][str(token)] - row[token]))
            greedy_ok.append(bool(row.max() - row[token] <= ORACLE_TOL))
    return np.asarray(errors), greedy_ok


def teacher_forced(model, batch: list[dict], want: list[list[int]]) -> tuple[float, float]:
    """Over the unquantized greedy continuations `want` fed back as prompts (`batch` ran
    PROMPTS[i] + want[i] with prompt_logprobs=1): the share of positions whose top-1 token is the
    unquantized one, and the mean |logprob error| of that token against transformers float32."""
    agree, errors = [], []
    for prompt, cont, result in zip(PROMPTS, want, batch):
        rows = result["prompt_logprobs"]
        ref = hf_logprobs(model, prompt + cont)
        for j, token in enumerate(cont):
            row = rows[len(prompt) + j]
            agree.append(int(max(row, key=row.get)) == token)
            errors.append(abs(row[str(token)] - ref[len(prompt) + j - 1, token]))
    return float(np.mean(agree)), float(np.mean(errors))


def _jobs(model) -> list[dict]:
    params = [greedy(MAX_TOKENS, logprobs=1)]
    want = hf_greedy(model, PROMPTS, MAX_TOKENS)
    forced = [p + w for p, w in zip(PROMPTS, want)]
    return [
        {"prompts": PROMPTS, "params": params},
        # The same prompts again: their prefixes are read back from the cached blocks.
        {"prompts": PROMPTS, "params": params},
        {"prompts": forced, "params": [greedy(1, prompt_logprobs=1)]},
    ]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def fp8_run(model):
    # Room for 20 blocks of 16 tokens at one byte per element: the first round needs 33
    # (preemption), one 256-token request fits.
    engine = {
        "kv_cache_dtype": "fp8",
        "max_model_len": 256,
        "kv_cache_memory_bytes": 20 * kv_block_bytes(model, dtype_bytes=1),
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 64,
        "disable_log_stats": False,
    }
    return run_engine_job(model, _jobs(model), engine=engine, with_metrics="per_job")


def test_fp8_cache_matches_the_fp8_oracle(model, fp8_run) -> None:
    (first, second, _), metrics = fp8_run
    oracle = functools.partial(hf_fp8_kv_logprobs, name="fp8_e4m3")
    errors, greedy_ok = _logprob_rows(model, first, oracle)
    assert errors.max() <= ORACLE_TOL, errors.max()
    assert all(greedy_ok)
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    # Prefix-cache hits read back the bytes the first round wrote.
    hits = [m.get("vllm:prefix_cache_hits", 0) for m in metrics]
    assert hits[1] > hits[0], hits
    assert tokens(second) == tokens(first)


def test_fp8_cache_cost_against_the_unquantized_cache(model, fp8_run) -> None:
    (_, _, forced), _ = fp8_run
    share, error = teacher_forced(model, forced, hf_greedy(model, PROMPTS, MAX_TOKENS))
    print(f"plugin fp8_e4m3: teacher-forced agreement {share:.3f}, logprob error {error:.4f}")
    assert share >= MIN_AGREEMENT["fp8_e4m3"] and error <= MAX_MEAN_ERROR["fp8_e4m3"]


@pytest.mark.full
@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_agreement_is_at_least_vllm_cpus(model, fp8_run, dtype) -> None:
    """vLLM's own CPU backend with the same fp8 setting on the same checkpoint, measured the same
    way: the plugin agrees with the unquantized cache at least as well (the issue's bar)."""
    want = hf_greedy(model, PROMPTS, MAX_TOKENS)
    forced = _jobs(model)[2:]
    if dtype == "fp8_e4m3":
        (_, _, ours), _ = fp8_run
    else:
        (ours,) = run_engine_job(model, forced, engine={"kv_cache_dtype": dtype})
    (cpu,) = run_engine_job(model, forced, backend="cpu", engine={"kv_cache_dtype": dtype})
    (our_share, our_error), (cpu_share, cpu_error) = (
        teacher_forced(model, ours, want),
        teacher_forced(model, cpu, want),
    )
    print(f"{dtype}: agreement plugin {our_share:.3f} vLLM CPU {cpu_share:.3f}; logprob error "
          f"plugin {our_error:.4f} vLLM CPU {cpu_error:.4f}")  # fmt: skip
    assert our_share >= MIN_AGREEMENT[dtype] and our_error <= MAX_MEAN_ERROR[dtype]
    assert our_share >= cpu_share


@pytest.mark.full
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_sliding_windows_read_fp8_like_the_oracle(tiny_model_dir, arch) -> None:
    """Windows over fp8 pages: Mistral (every layer windowed) and Gemma 3 (sliding and full layers
    in two KV-cache groups over shared regions), prompts longer than the window."""
    model = tiny_model_dir(arch)
    prompts = random_prompts(44, [40, 70, 9])
    jobs = [{"prompts": prompts, "params": [greedy(16, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": "fp8"})
    oracle = functools.partial(hf_fp8_kv_logprobs, name="fp8_e4m3")
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = oracle(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            row = ref[len(prompt) - 1 + step]
            assert abs(sample["logprobs"][step][str(token)] - row[token]) <= ORACLE_TOL
            assert row.max() - row[token] <= ORACLE_TOL


@pytest.mark.full
def test_ngram_verification_over_fp8_pages_is_lossless(model) -> None:
    """Verification rows (1 + drafts per sequence) read the fp8 pages as decode rows do: greedy
    tokens with n-gram drafts equal those without."""
    prompts = [p + p[:12] + p for p in random_prompts(45, [20, 33])]  # drafts find matches
    jobs = [{"prompts": prompts, "params": [greedy(24)]}]
    (plain,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": "fp8"})
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = {"kv_cache_dtype": "fp8", "speculative_config": spec, "disable_log_stats": False}
    (drafted,), metrics = run_engine_job(model, jobs, engine=engine, with_metrics=True)
    assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) >= 1, metrics
    assert tokens(drafted) == tokens(plain)


@pytest.mark.full
def test_gemma4_shared_kv_layers_read_their_writers_fp8(tiny_gemma4_dir) -> None:
    """Gemma 4: two head sizes in one pool and layers reading another layer's fp8 K/V. Its
    float32 K/V differ from transformers' in the last bits, which now and then moves a value across
    an fp8 rounding boundary: the mean error bounds that (measured 1.2e-3; a wrong scale or region
    is about 0.1, the format's own cost)."""
    prompts = random_prompts(31, [30, 26, 35, 5])
    jobs = [{"prompts": prompts, "params": [greedy(12, logprobs=1)]}]
    (batch,) = run_engine_job(tiny_gemma4_dir, jobs, engine={"kv_cache_dtype": "fp8"})
    oracle = functools.partial(hf_fp8_kv_logprobs, name="fp8_e4m3")
    errors = []
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = oracle(tiny_gemma4_dir, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            errors.append(
                abs(sample["logprobs"][step][str(token)] - ref[len(prompt) - 1 + step, token])
            )
    assert np.mean(errors) <= 5e-3 and max(errors) <= 0.1, (np.mean(errors), max(errors))
