"""Quantized KV caches on hybrid models (Qwen3.5: three Gated DeltaNet layers to each gated
full-attention layer; Nemotron-H and Falcon-H1: Mamba-2; LFM2: short convolutions): the attention
layers' pages hold the format's bytes while the state layers keep their float32 state in the same
regions, unquantized.

Oracle: transformers float32 whose attention layers read keys and values through the float64 port
of the format (fp8: `fp8_reference`; per-token-head: `per_token_head_reference`), its state layers
untouched. The engine follows it at least ten times more closely than the format moves the
logprobs from the unquantized model; a state page stored quantized was 1.2e-2 nats off on
Qwen3.5 (bound 5e-4). Measured through chunked prefill, preemption and, with prefix caching, hits
that start from a cached state page and read the stored attention rows back. The cost against the
unquantized cache is measured teacher-forced, as for dense models (docs/kv-cache.md)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    errors_and_shift,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.fixtures.fp8_reference import hf_fp8_kv_logprobs
from tests.fixtures.oracles import hf_greedy, hf_logprobs
from tests.fixtures.per_token_head_reference import hf_per_token_head_kv_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.full]

FORMATS = ["fp8", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]
# Bytes per token and KV head of an attention page (K and V) for a head size of 32 / 64.
HEAD_BYTES = {
    32: {"fp8": 64, "int8_per_token_head": 72, "fp8_per_token_head": 72, "int4_per_token_head": 40},
    64: {"fp8": 128, "int8_per_token_head": 136, "fp8_per_token_head": 136,
         "int4_per_token_head": 72},
}  # fmt: skip
# Per family: its checkpoint fixture, (KV heads, head size) of its attention layers, the bytes
# of one state page (float32 model: tests/backends/mlx/runner/test_hybrid.py) and the KV
# tensors vLLM allocates per block id.
FAMILIES = {
    "qwen3_5": ("tiny_qwen3_5_dir", (1, 64), 35_840, 1),
    "nemotron_h": ("tiny_nemotron_h_dir", (2, 32), 10_496, 1),
    "falcon_h1": ("tiny_falcon_h1_dir", (1, 64), 10_496, 2),
    # LFM2's short convolutions: a window of 2 x 256 float32 values.
    "lfm2": ("tiny_lfm2_dir", (2, 64), 2_048, 1),
}
# Each sampled token's logprob against the port's oracle; float32 accumulation order now and then
# moves a value across a rounding boundary of the format (as on dense models).
ORACLE_TOL = {"fp8": 2e-3, "int8_per_token_head": 2e-3, "fp8_per_token_head": 5e-3,
              "int4_per_token_head": 2e-2}  # fmt: skip


def _token_bytes(family: str, dtype: str) -> int:
    heads, head_size = FAMILIES[family][1]
    return heads * HEAD_BYTES[head_size][dtype]


def _block_size(family: str, dtype: str) -> int:
    """The block size the platform must pick so that a block's attention page holds a state
    page: the smallest multiple of 16 tokens that does (`kv.state.align_block_size`)."""
    per16 = 16 * _token_bytes(family, dtype)
    return 16 * -(-FAMILIES[family][2] // per16)


MAX_TOKENS = 16


def _oracle(dtype: str):
    if dtype == "fp8":
        return functools.partial(hf_fp8_kv_logprobs, name="fp8_e4m3")
    return functools.partial(hf_per_token_head_kv_logprobs, kv_cache_dtype=dtype)


def _errors(model, prompts, batch, oracle) -> np.ndarray:
    """|engine - oracle| of every sampled token's logprob."""
    errors = []
    for prompt, result in zip(prompts, batch):
        sample = result["outputs"][0]
        ref = oracle(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            errors.append(
                abs(sample["logprobs"][step][str(token)] - ref[len(prompt) - 1 + step, token])
            )
    return np.asarray(errors)


def _prompts(block_size: int) -> list[list[int]]:
    """Prompts of several 32-token chunks that cross a block while decoding, then a
    single-token and a short one (FCFS: the long ones run first)."""
    return random_prompts(61, [block_size - 10, block_size - 14, block_size - 5, 1, 5])


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3_5", dtype) for dtype in FORMATS]
    + [(family, dtype) for family in ("nemotron_h", "falcon_h1")
       for dtype in ("fp8", "int4_per_token_head")]
    + [("lfm2", "fp8"), ("lfm2", "int4_per_token_head")],
)  # fmt: skip
def test_attention_pages_quantized_state_pages_not(request, family, dtype) -> None:
    """Chunked prefill (32 tokens) and preemption (a pool of 13 blocks: three requests take
    their state blocks and an attention block each and cannot all take their next)."""
    fixture, _, _, tensors = FAMILIES[family]
    model = request.getfixturevalue(fixture)
    block = _block_size(family, dtype)
    prompts = _prompts(block)
    engine = {
        "kv_cache_dtype": dtype,
        "max_num_batched_tokens": 32,
        "kv_cache_memory_bytes": 13 * block * _token_bytes(family, dtype) * tensors,
        "max_model_len": 2 * block,
        "disable_log_stats": False,
    }
    jobs = [{"prompts": prompts, "params": [greedy(MAX_TOKENS, logprobs=1)]}]
    (batch,), metrics = run_engine_job(model, jobs, engine=engine, with_metrics=True)
    errors = _errors(model, prompts, batch, _oracle(dtype))
    # The same tokens against the unquantized model: what the format moves, which the engine must
    # follow far more closely than that (an unquantized attention page would not).
    moved = _errors(model, prompts, batch, hf_logprobs)
    print(f"{family} {dtype}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}"
          f"; the format moves them by {moved.mean():.2e}")  # fmt: skip
    assert errors.mean() <= ORACLE_TOL[dtype] / 4 and errors.max() <= 10 * ORACLE_TOL[dtype]
    assert errors.mean() * 10 <= moved.mean()
    assert metrics.get("vllm:num_preemptions", 0) >= 1, sorted(metrics.items())


# Teacher-forced prompts for the cost against the unquantized cache (as on dense models: 8 prompts,
# 24 forced positions each).
FORCED_PROMPTS = random_prompts(43, [5, 17, 40, 64, 23, 90, 9, 33])
FORCED_TOKENS = 24
# Bounds under the agreement measured here (docs/kv-cache.md, "Accuracy cost"); a state page
# stored quantized or read as bytes falls far below.
MIN_AGREEMENT = {"fp8": 0.85, "int8_per_token_head": 0.9, "fp8_per_token_head": 0.85,
                 "int4_per_token_head": 0.6}  # fmt: skip


@pytest.mark.parametrize("dtype", FORMATS)
def test_prefix_hits_and_cost_against_the_unquantized_cache(tiny_qwen3_5_dir, dtype) -> None:
    """With prefix caching (vLLM's "align" mamba mode): two prompts longer than a block run
    twice; the second round starts from the cached state page of the last whole block and reads
    the stored attention rows back, giving the first round's tokens and logprobs. Then the share
    of teacher-forced positions whose top-1 token is the unquantized cache's (transformers
    float32), and the mean |logprob error| of that token."""
    model = tiny_qwen3_5_dir
    block = _block_size("qwen3_5", dtype)
    long = random_prompts(62, [block + 20, block + 60])
    want = hf_greedy(model, FORCED_PROMPTS, FORCED_TOKENS)
    forced = [p + w for p, w in zip(FORCED_PROMPTS, want)]
    params = [greedy(MAX_TOKENS, logprobs=1)]
    jobs = [
        {"prompts": long, "params": params},
        {"prompts": long, "params": params},
        {"prompts": forced, "params": [greedy(1, prompt_logprobs=1)]},
    ]
    engine = {
        "kv_cache_dtype": dtype,
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 2 * block,
        "kv_cache_memory_bytes": 24 * block * _token_bytes("qwen3_5", dtype),
        "max_model_len": 2 * block,
        "disable_log_stats": False,
    }
    (first, second, teacher), metrics = run_engine_job(
        model, jobs, engine=engine, with_metrics="per_job"
    )
    hits = [m.get("vllm:prefix_cache_hits", 0) for m in metrics]
    assert hits[1] - hits[0] >= 2 * block, hits
    assert tokens(second) == tokens(first)
    for a, b in zip(second, first):
        for x, y in zip(a["outputs"][0]["logprobs"], b["outputs"][0]["logprobs"]):
            assert abs(next(iter(x.values())) - next(iter(y.values()))) <= 1e-5
    errors = _errors(model, long, first, _oracle(dtype))
    assert errors.mean() <= ORACLE_TOL[dtype] / 4 and errors.max() <= 10 * ORACLE_TOL[dtype]

    agree, lp_errors = [], []
    for prompt, cont, result in zip(FORCED_PROMPTS, want, teacher):
        rows = result["prompt_logprobs"]
        ref = hf_logprobs(model, prompt + cont)
        for j, token in enumerate(cont):
            row = rows[len(prompt) + j]
            agree.append(int(max(row, key=row.get)) == token)
            lp_errors.append(abs(row[str(token)] - ref[len(prompt) + j - 1, token]))
    share, error = float(np.mean(agree)), float(np.mean(lp_errors))
    print(f"qwen3_5 {dtype}: hits {hits}; teacher-forced agreement {share:.3f}, "
          f"logprob error {error:.4f}")  # fmt: skip
    assert share >= MIN_AGREEMENT[dtype]


# TurboQuant slots per token and KV head of 64 / 32 (`ops.turboquant.codec`: k8v4 an fp8 key and
# 4-bit values with a float16 scale and minimum; 3bit_nc 3-bit key indices with a float16 norm
# and 3-bit values).
TURBOQUANT_SLOT = {("turboquant_k8v4", 64): 100, ("turboquant_3bit_nc", 64): 54,
                   ("turboquant_k8v4", 32): 52}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "name"),
    [("qwen3_5", "turboquant_k8v4"), ("qwen3_5", "turboquant_3bit_nc"),
     ("nemotron_h", "turboquant_k8v4"), ("lfm2", "turboquant_k8v4"),
     ("lfm2", "turboquant_3bit_nc")],
)  # fmt: skip
def test_turboquant_pages_of_a_hybrids_attention_layers(request, family, name) -> None:
    """vLLM keeps no boundary layers unquantized in a hybrid, so its attention layers store
    slots beside the float state pages: prompts in one prefill chunk (attending unquantized, as
    vLLM's first chunk does) and decode rows over the stored slots, against the port's oracle
    with no layer skipped. (Qwen3.5's 3bit_nc key slots, 26 bytes, are no whole 4-byte word:
    state pages are moved as bytes.) vLLM 0.32 itself refuses TurboQuant on Falcon-H1 at startup
    ("requires identifiable full-attention layers")."""
    from tests.fixtures.turboquant_reference import hf_turboquant_logprobs

    fixture, (heads, head_size), state_bytes, tensors = FAMILIES[family]
    model = request.getfixturevalue(fixture)
    token_bytes = heads * TURBOQUANT_SLOT[name, head_size]
    block = 16 * -(-state_bytes // (16 * token_bytes))
    prompts = random_prompts(64, [5, 40, 90])
    engine = {
        "kv_cache_dtype": name,
        "max_num_batched_tokens": 256,
        "kv_cache_memory_bytes": 16 * block * token_bytes * tensors,
        "max_model_len": max(block, 128),
    }
    jobs = [{"prompts": prompts, "params": [greedy(MAX_TOKENS, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine=engine)

    def oracle(prompt, ids):
        # vLLM schedules a hybrid's prompt in chunks of a block under prefix caching (states are
        # kept at block boundaries): only the first attends over its rows unquantized.
        return hf_turboquant_logprobs(model, ids, name, min(len(prompt), block), skip=())

    errors, moved = errors_and_shift(model, prompts, batch, oracle)
    print(f"{family} {name}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}; "
          f"the format moves them by {moved.mean():.2e}")  # fmt: skip
    assert errors.max() <= 5e-3
    assert errors.mean() * 10 <= moved.mean()


def test_checkpoint_scales_reach_a_hybrids_attention_layer(tiny_nemotron_h_dir, tmp_path) -> None:
    """Nemotron-H's attention block is decoder block 2 but its second layer with KV memory (the
    MLP-only and MoE blocks have none): the checkpoint's scales named `backbone.layers.2` reach it
    by its module name. The engine follows the fp8 oracle at those scales, not at 1.0."""
    import shutil

    from safetensors.numpy import save_file

    model = tmp_path / "scaled"
    shutil.copytree(tiny_nemotron_h_dir, model)
    scales = {"k_scale": 8.0, "v_scale": 4.0}
    save_file(
        {f"backbone.layers.2.mixer.{k}": np.array(v, np.float32) for k, v in scales.items()},
        str(model / "kv_scales.safetensors"),
    )
    prompts = random_prompts(62, [20, 33, 7])
    jobs = [{"prompts": prompts, "params": [greedy(MAX_TOKENS, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine={"kv_cache_dtype": "fp8"})
    oracle = functools.partial(hf_fp8_kv_logprobs, name="fp8_e4m3", **scales)
    errors = _errors(model, prompts, batch, oracle)
    unscaled = _errors(model, prompts, batch, _oracle("fp8"))
    print(f"nemotron_h fp8 at the checkpoint's scales: |logprob - oracle| mean {errors.mean():.2e}"
          f" max {errors.max():.2e}; against the oracle at 1.0 {unscaled.mean():.2e}")  # fmt: skip
    assert errors.mean() <= ORACLE_TOL["fp8"] / 4 and errors.max() <= 10 * ORACLE_TOL["fp8"]
    assert errors.mean() * 10 <= unscaled.mean()


@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head"])
@pytest.mark.parametrize("fixture", ["tiny_qwen3_next_dir", "tiny_granitemoehybrid_dir"])
def test_qwen3_next_and_granite_h_attention_pages(request, fixture, dtype) -> None:
    """Qwen3-Next (Gated DeltaNet) and Granite 4.0-H (Mamba-2), which take quantized pages
    through the same path as the families above, in chunks of 32 tokens: the port's oracle, far
    closer than the format moves the logprobs."""
    model = request.getfixturevalue(fixture)
    prompts = random_prompts(63, [40, 75, 9, 1])
    engine = {"kv_cache_dtype": dtype, "max_num_batched_tokens": 32}
    jobs = [{"prompts": prompts, "params": [greedy(MAX_TOKENS, logprobs=1)]}]
    (batch,) = run_engine_job(model, jobs, engine=engine)
    errors = _errors(model, prompts, batch, _oracle(dtype))
    moved = _errors(model, prompts, batch, hf_logprobs)
    print(f"{fixture} {dtype}: |logprob - oracle| mean {errors.mean():.2e} max {errors.max():.2e}"
          f"; the format moves them by {moved.mean():.2e}")  # fmt: skip
    assert errors.mean() <= ORACLE_TOL[dtype] / 4 and errors.max() <= 10 * ORACLE_TOL[dtype]
    assert errors.mean() * 10 <= moved.mean()
