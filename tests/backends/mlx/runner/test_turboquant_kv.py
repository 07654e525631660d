"""TurboQuant KV caches (--kv-cache-dtype turboquant_*) serve what transformers float32 computes when
its quantized layers read keys and values through a float64 port of vLLM's store -> decode rules
(prompt rows over the unquantized step, as vLLM's first prefill chunk; decode rows over the stored
slots), and stay close to the unquantized cache through chunked prefill, preemption, prefix-cache
hits, sliding windows and n-gram verification; the cost is measured against the unquantized cache
(docs/kv-cache.md, "TurboQuant")."""

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
from tests.fixtures.oracles import hf_greedy, hf_logprobs
from tests.fixtures.turboquant_reference import PRESETS, hf_turboquant_logprobs

pytestmark = pytest.mark.slow

# Six layers: vLLM keeps layers 0, 1, 4 and 5 at the model's dtype and quantizes 2 and 3.
NUM_LAYERS = 6
PROMPTS = random_prompts(43, [5, 17, 40, 64, 23, 90, 9, 33])
MAX_TOKENS = 24
# Each sampled token's logprob against the oracle: float32 against float64 arithmetic, where a
# coordinate near a rounding decision may store the neighbouring level (measured at most 2.7e-4
# over the presets, docs/kv-cache.md); dropping the norm correction or vLLM's prefill rule fails
# the CI test below.
ORACLE_TOL = 5e-3
# Against the unquantized cache (192 generated tokens, `own_path_cost`): bounds under the measured
# cost (docs/kv-cache.md); a wrong dequantization costs whole nats.
MIN_AGREEMENT = {
    "turboquant_k8v4": 0.97,
    "turboquant_4bit_nc": 0.97,
    "turboquant_k3v4_nc": 0.95,
    "turboquant_3bit_nc": 0.95,
}
MAX_MEAN_ERROR = 0.06


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("qwen3", num_layers=NUM_LAYERS)


def assert_matches_oracle(model, prompts, batch, name) -> None:
    errors = []
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = hf_turboquant_logprobs(model, prompt + sample["token_ids"], name, len(prompt))
        for step, token in enumerate(sample["token_ids"]):
            row = ref[len(prompt) - 1 + step]
            errors.append(abs(sample["logprobs"][step][str(token)] - row[token]))
            assert row.max() - row[token] <= ORACLE_TOL, (step, row.max() - row[token])
    print(f"{name}: max |logprob - oracle| {max(errors):.2e}, mean {np.mean(errors):.2e}")
    assert max(errors) <= ORACLE_TOL


def test_turboquant_cache_matches_the_oracle(model) -> None:
    """Each prompt one prefill chunk, then decode steps, batched: every sampled token's logprob is
    the oracle's."""
    name = "turboquant_4bit_nc"
    prompts = PROMPTS[:4]
    jobs = [{"prompts": prompts, "params": [greedy(12, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name, "max_model_len": 256})
    assert_matches_oracle(model, prompts, batch, name)


@pytest.mark.full
@pytest.mark.parametrize("name", [n for n in PRESETS if n != "turboquant_4bit_nc"])
def test_every_preset_matches_the_oracle(model, name) -> None:
    prompts = PROMPTS[:4]
    jobs = [{"prompts": prompts, "params": [greedy(12, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name, "max_model_len": 256})
    assert_matches_oracle(model, prompts, batch, name)


def own_path_cost(model, batch: list[dict]) -> tuple[float, float]:
    """Over every generated token of `batch` (PROMPTS run greedily with logprobs=1): the share
    that are transformers float32's (the unquantized cache's) greedy choice after the same
    prefix, and the mean |logprob error| of the token against it. Decode steps read the cache, so
    this measures the format where it is read (a prompt's first chunk attends unquantized)."""
    agree, errors = [], []
    for prompt, result in zip(PROMPTS, batch):
        sample = result["outputs"][0]
        ref = hf_logprobs(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            row = ref[len(prompt) - 1 + step]
            agree.append(row.max() - row[token] <= 1e-4)
            errors.append(abs(sample["logprobs"][step][str(token)] - row[token]))
    return float(np.mean(agree)), float(np.mean(errors))


def _jobs() -> list[dict]:
    params = [greedy(MAX_TOKENS, logprobs=1)]
    # The same prompts twice: the second round reads their prefixes from the cached blocks.
    return [{"prompts": PROMPTS, "params": params}, {"prompts": PROMPTS, "params": params}]


@functools.cache
def _composed_run(model, name):
    # Room for 24 blocks of 16 tokens (the quantized layers' pages are smaller): the first round
    # needs more (preemption); chunks of 32 tokens (continuations read the stored slots).
    engine = {
        "kv_cache_dtype": name,
        "max_model_len": 256,
        "kv_cache_memory_bytes": 20 * kv_block_bytes(model),
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 32,
        "disable_log_stats": False,
    }
    return run_engine_job(model, _jobs(), engine=engine, with_metrics="per_job")


@pytest.mark.full
@pytest.mark.parametrize("name", list(PRESETS))
def test_cost_against_the_unquantized_cache(model, name) -> None:
    """Chunked prefill, preemption and prefix-cache hits over TurboQuant pages: agreement with
    the unquantized cache and the mean |logprob error| stay within the format's measured cost
    (docs/kv-cache.md), both rounds."""
    (first, second), metrics = _composed_run(model, name)
    assert metrics[0].get("vllm:num_preemptions", 0) >= 1, sorted(metrics[0].items())
    hits = [m.get("vllm:prefix_cache_hits", 0) for m in metrics]
    assert hits[1] > hits[0], hits
    want = hf_greedy(model, PROMPTS, MAX_TOKENS)
    for batch in (first, second):
        share, error = own_path_cost(model, batch)
        same = np.mean([a == b for t, w in zip(tokens(batch), want) for a, b in zip(t, w)])
        print(f"plugin {name}: agreement {share:.3f}, logprob error {error:.4f}, greedy tokens "
              f"equal to the unquantized run's {same:.3f}")  # fmt: skip
        assert share >= MIN_AGREEMENT[name] and error <= MAX_MEAN_ERROR


@pytest.mark.full
def test_sliding_windows_over_turboquant_pages(tiny_model_dir) -> None:
    """Mistral, every layer windowed, prompts longer than the window: the oracle's logprobs."""
    model = tiny_model_dir("mistral", num_layers=NUM_LAYERS, sliding_window=24)
    name = "turboquant_k3v4_nc"
    prompts = random_prompts(44, [40, 70, 9])
    jobs = [{"prompts": prompts, "params": [greedy(16, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name})
    assert_matches_oracle(model, prompts, batch, name)


@pytest.mark.full
def test_ngram_verification_reads_the_slots_as_decode_rows_do(model) -> None:
    """Verification rows (1 + drafts, a short continuation) read every key from the cache, as
    decode rows do: greedy tokens with n-gram drafts equal those without."""
    name = "turboquant_k8v4"
    # Periodic prompts: a draft needs the model's own tokens to repeat earlier context, which
    # this random checkpoint does now and then there.
    prompts = [b * (60 // len(b)) for b in random_prompts(45, [3, 4, 5, 6, 3, 4])]
    jobs = [{"prompts": prompts, "params": [greedy(32)]}]
    (plain,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name})
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    engine = {"kv_cache_dtype": name, "speculative_config": spec, "disable_log_stats": False}
    # Drafts on every step: the back-off would judge them by step times, which vary here.
    env = {"VLLM_METAL_SPEC_BACKOFF": "0"}
    (drafted,), metrics = run_engine_job(model, jobs, engine=engine, with_metrics=True, env=env)
    assert metrics.get("vllm:spec_decode_num_accepted_tokens", 0) >= 1, metrics
    assert tokens(drafted) == tokens(plain)


@pytest.mark.full
@pytest.mark.parametrize("name", list(PRESETS))
def test_agreement_beside_vllm_cpus(model, name) -> None:
    """vLLM's CPU backend with the same setting, measured the same way. It does not refuse the
    TurboQuant names, but runs them through its fp8 path (`is_quantized_kv_cache`): one byte per
    element, per-tensor scale 1.0, in the layers outside the boundary, which is not TurboQuant.
    Its figures are reported beside the plugin's (docs/kv-cache.md); the plugin agrees with the
    unquantized cache at least as well (the issue's bar) and within its own measured cost."""
    jobs = _jobs()[:1]
    (ours,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": name})
    (cpu,) = run_engine_job(model, jobs, backend="cpu", engine={"kv_cache_dtype": name})
    (our_share, our_error), (cpu_share, cpu_error) = (
        own_path_cost(model, ours),
        own_path_cost(model, cpu),
    )
    print(f"{name}: agreement plugin {our_share:.3f} vLLM CPU {cpu_share:.3f}; logprob error "
          f"plugin {our_error:.4f} vLLM CPU {cpu_error:.4f}")  # fmt: skip
    assert our_share >= MIN_AGREEMENT[name] and our_error <= MAX_MEAN_ERROR
    assert our_share >= cpu_share


@pytest.mark.full
@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_the_host_tier_carries_the_slot_bytes_unchanged(model, name) -> None:
    """A prompt evicted from the pool and served back from the KV offload's host tier computes
    what the same prompt computes over its blocks kept in the pool (a prefix-cache hit without
    offloading): equal tokens and logprobs, so the tier moved every boundary layer's float page
    and every quantized layer's key and value slots as they were stored."""
    from tests.kv.test_offload_engine import BLOCK, FULL_BLOCKS, HOST_GIB, A, B, C, _delta

    # Per 16-token block: 4 boundary layers of float32 K/V and 2 layers of slots (2 KV heads).
    slot = {"turboquant_k8v4": 100, "turboquant_3bit_nc": 54}[name]
    page = BLOCK * 2 * (4 * 2 * 64 * 4 + 2 * slot)
    jobs = [{"prompts": [p], "params": [greedy(8, logprobs=1)]} for p in (A, B, C, A)]
    engine = {
        "kv_cache_dtype": name,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "disable_log_stats": False,
    }
    # 60 blocks: A's 19 stay cached beside B's and C's.
    kept = run_engine_job(model, jobs, engine={**engine, "kv_cache_memory_bytes": 60 * page})
    # 40 blocks: C evicts A; the host tier holds it.
    engine = {**engine, "kv_cache_memory_bytes": 40 * page, "kv_offloading_size": HOST_GIB}
    tiered, metrics = run_engine_job(model, jobs, engine=engine, with_metrics="per_job")
    assert kept[3][0]["num_cached_tokens"] == FULL_BLOCKS * BLOCK  # a device hit
    assert tiered[3][0]["num_cached_tokens"] == FULL_BLOCKS * BLOCK
    assert _delta(metrics, "vllm:kv_offload_host_hit_blocks")[3] == FULL_BLOCKS
    assert _delta(metrics, "vllm:kv_offload_store_bytes")[0] == FULL_BLOCKS * page
    assert tokens(tiered[3]) == tokens(kept[3])
    for x, y in zip(tiered[3][0]["outputs"][0]["logprobs"], kept[3][0]["outputs"][0]["logprobs"]):
        assert next(iter(x.values())) == pytest.approx(next(iter(y.values())), abs=1e-5)
