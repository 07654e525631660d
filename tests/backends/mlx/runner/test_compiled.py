"""Compiled decode steps (`runner/compiled.py`) equal eager ones: the same tokens, hidden states
and written K/V, step after step, for dense, sliding-window, soft-capped, MoE, KV-sharing, sink,
latent-attention (MLA) and quantized decoders, at batch sizes and context lengths that pad rows
and block-table columns, on the native ops and on their pure-MLX versions (the GPU proxy's
path); the kinds it does not trace stay eager by name.
An engine with compiled decode gives transformers float32's greedy tokens and logprobs over a
mixed batch with chunked prefill, preemption and a prefix-cache round (one engine, CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import (
    COMPILED_ENV,
    greedy,
    kv_block_bytes,
    random_prompts,
    run_engine_job,
)
from tests.backends.mlx.runner.jobs import tokens as tokens_of
from tests.fixtures.oracles import hf_greedy, hf_logprobs
from vllm_metal.backends.mlx.runner import compiled
from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import hidden_states
from vllm_metal.backends.mlx.runner.model_states.interface import (
    NO_INPUTS,
    AuxHidden,
    StepInputs,
)
from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.kv.quant import kv_cache_quant
from vllm_metal.kv.turboquant import TurboQuantCache
from vllm_metal.models import load_model
from vllm_metal.models.layers import memory_layers
from vllm_metal.ops import per_token_head

BLOCK = 16
PROMPT_LENS = (5, 21, 40, 9, 30)  # one, two and three blocks
STEPS = 20  # every row crosses a block boundary; block tables grow from 3 to 4 columns


def _prefilled(model_dir, kv_cache_dtype: str = "auto"):
    """A loaded model and a pool holding five prompts (eager prefill), with what decodes next;
    an fp8 pool with `kv_cache_dtype` fp8."""
    adapter = load_model(str(model_dir), compute_dtype=mx.float32)
    kinds = adapter.layer_kinds()
    heads, dim = _kv_shape(model_dir)
    layout = KVLayout.single_group(len(kinds), 48, BLOCK, memory_layers(kinds))
    quant = kv_cache_quant(kv_cache_dtype, len(kinds))
    pool = pool_for(layout, kinds, heads, dim, mx.float32, quant)
    n = len(PROMPT_LENS)
    tables = np.zeros((n, 8), dtype=np.int32)
    for i in range(n):
        tables[i] = np.arange(1 + 8 * i, 9 + 8 * i)
    rng = np.random.default_rng(0)
    table = np.zeros((n, 128), dtype=np.int64)
    for i, length in enumerate(PROMPT_LENS):
        table[i, :length] = rng.integers(1, 200, size=length)
    ids = [str(i) for i in range(n)]
    lens = np.array(PROMPT_LENS)
    packed = pack_batch(
        ids, dict(zip(ids, PROMPT_LENS)), np.zeros(n), lens, table, [tables], [BLOCK]
    )
    hidden = hidden_states(adapter, pool, kinds, packed)
    first = mx.argmax(adapter.logits(hidden[mx.array(packed.logits_indices)]), axis=-1)
    mx.eval(first, pool.arrays())
    return adapter, kinds, pool, tables, lens, np.array(first).reshape(-1)


def _kv_shape(model_dir) -> tuple[int, int]:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return heads, config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _decode(adapter, kinds, pool, tables, lens, first, rows, step_fn):
    """`STEPS` greedy decode steps of the first `rows` requests: each step's hidden states and
    tokens, and the K/V the requests' positions hold in the pool afterwards."""
    positions, toks, out = lens[:rows].copy(), first[:rows].copy(), []
    ids = [str(i) for i in range(rows)]
    for _ in range(STEPS):
        packed = decode_batch(ids, positions, toks, [tables[:rows]], [BLOCK])
        hidden = step_fn(pool, packed)
        logits = adapter.logits(hidden)
        mx.eval(logits, pool.arrays())
        toks = np.array(mx.argmax(logits, axis=-1)).reshape(-1)
        out.append((np.array(hidden), toks))
        positions = positions + 1
    return out, _written(pool, tables, positions)


def _eager(adapter, kinds):
    """The eager forward as a step function of `_decode`."""
    return lambda pool, packed: hidden_states(adapter, pool, kinds, packed)


def _assert_same(got, want, tol: float = 5e-4, kv_cache_dtype: str = "auto") -> None:
    """The same tokens at every step; hidden states and written K/V within `tol` (values of a
    few units: MLX's fused elementwise kernels round differently from the separate ops). Of
    quantized K/V, a value on a rounding edge may go either way: fp8 bytes may be one code
    apart, per-token-head rows one step of their scale, in at most one value in a thousand."""
    (got_steps, got_kv), (want_steps, want_kv) = got, want
    for (hidden, toks), (want_hidden, want_toks) in zip(got_steps, want_steps, strict=True):
        assert toks.tolist() == want_toks.tolist()
        np.testing.assert_allclose(hidden, want_hidden, rtol=tol, atol=tol)
    for a, b in zip(got_kv, want_kv, strict=True):
        if per_token_head.is_per_token_head(kv_cache_dtype):
            a, b = (
                np.array(per_token_head.dequantize(mx.array(x), kv_cache_dtype, mx.float32))
                for x in (a, b)
            )
            off = np.abs(a - b) > tol + tol * np.abs(b)
        elif a.dtype == np.uint8:
            assert np.abs(a.astype(np.int16) - b).max() <= 1
            off = a != b
        else:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
            continue
        assert np.count_nonzero(off) <= a.size // 1000, np.count_nonzero(off)


FAMILY_CASES = {
    "qwen3": {},
    "gemma2": {"sliding_window": 24},  # soft-capped logits, every other layer a window
    "gemma3": {"sliding_window": 24},
    "mistral": {"sliding_window": 24},
}


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize("arch", list(FAMILY_CASES))
def test_compiled_steps_equal_eager(tiny_model_dir, monkeypatch, arch, reference_ops):
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    model = tiny_model_dir(arch, **FAMILY_CASES[arch])
    for rows in (5, 3):  # 5 rows pad to 6, 3 fill their bucket
        adapter, kinds, pool, tables, lens, first = _prefilled(model)
        assert compiled.eager_reason(adapter, kinds, _Config()) is None
        want = _decode(adapter, kinds, pool, tables, lens, first, rows, _eager(adapter, kinds))
        adapter, kinds, pool, tables, lens, first = _prefilled(model)
        step = compiled.CompiledDecode(adapter, kinds)
        got = _decode(adapter, kinds, pool, tables, lens, first, rows, step.hidden_states)
        assert step.steps == STEPS
        _assert_same(got, want)


DRAFTS = 3  # at most, per request and step


def _verify(adapter, kinds, pool, tables, lens, rows, step_fn):
    """`STEPS` steps of the first `rows` requests, each feeding its next token and 0 to `DRAFTS`
    drafts (rows of one step differ in length; every fifth step all have `DRAFTS`), then
    keeping the first half of its drafts as if the rest were rejected, whose K/V later steps
    write again. Each step's hidden states and greedy tokens, and the K/V the requests'
    positions hold afterwards."""
    rng = np.random.default_rng(1)
    token_table = rng.integers(1, 200, size=(rows, 256))
    computed, ids, out = lens[:rows].copy(), [str(i) for i in range(rows)], []
    for step in range(STEPS):
        drafts = (np.arange(rows) + step) % (DRAFTS + 1)
        if step % 5 == 0:
            drafts[:] = DRAFTS
        scheduled = dict(zip(ids, (1 + drafts).tolist()))
        packed = pack_batch(
            ids, scheduled, computed, computed + 1, token_table, [tables[:rows]], [BLOCK], drafts
        )
        hidden = step_fn(pool, packed)
        logits = adapter.logits(hidden)
        mx.eval(logits, pool.arrays())
        out.append((np.array(hidden), np.array(mx.argmax(logits, axis=-1)).reshape(-1)))
        computed = computed + 1 + drafts // 2
    return out, _written(pool, tables, computed)


def _written(pool, tables, positions):
    """The K/V pool rows of each request's positions below `positions`."""
    slots = np.concatenate(
        [
            tables[r, np.arange(p) // BLOCK] * BLOCK + np.arange(p) % BLOCK
            for r, p in enumerate(positions)
        ]
    )
    return [np.array(a).reshape(-1, *a.shape[2:])[slots] for a in pool.arrays()]


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma2"])
def test_compiled_verify_steps_equal_eager(tiny_model_dir, monkeypatch, arch, reference_ops):
    """Steps verifying drafts compile, rows of fewer drafts padded to the longest: the same
    hidden states, tokens and K/V as eager steps, stale K/V of rejected drafts included."""
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    model = tiny_model_dir(arch, **FAMILY_CASES[arch])
    adapter, kinds, pool, tables, lens, _ = _prefilled(model)
    want = _verify(adapter, kinds, pool, tables, lens, 5, _eager(adapter, kinds))
    adapter, kinds, pool, tables, lens, _ = _prefilled(model)
    step = compiled.CompiledDecode(adapter, kinds)

    def traced(pool, packed):
        assert step.takes(pool, packed, NO_INPUTS)
        return step.hidden_states(pool, packed)

    got = _verify(adapter, kinds, pool, tables, lens, 5, traced)
    assert step.verify_steps == STEPS
    _assert_same(got, want)


def test_which_steps_compile(tiny_model_dir):
    """Decode and verification rows compile, with an EAGLE-3 head's aux layers too; a prefill
    row, media's key ends or drafts over a TurboQuant pool keep the step eager."""
    adapter, kinds, pool, tables, _, _ = _prefilled(tiny_model_dir("qwen3"))
    step = compiled.CompiledDecode(adapter, kinds)
    table = np.ones((2, 64), np.int64)
    plain = decode_batch(["0"], np.array([3]), np.array([7]), [tables[:1]], [BLOCK])
    assert step.takes(pool, plain, StepInputs(aux=AuxHidden((0, 1, 2))))
    assert not step.takes(pool, plain, StepInputs(key_ends=np.zeros(1, np.int32)))

    def packed(scheduled, drafts):
        ids = ["0", "1"]
        computed = np.array([10, 20])
        return pack_batch(
            ids, dict(zip(ids, scheduled)), computed, computed + 1, table, [tables[:2]],
            [BLOCK], np.array(drafts),
        )  # fmt: skip

    verifying = packed([3, 1], [2, 0])
    assert step.takes(pool, verifying, NO_INPUTS)
    assert not step.takes(pool, packed([3, 1], [0, 0]), NO_INPUTS)  # a prefill chunk
    assert not step.takes(pool, packed([4, 1], [2, 0]), NO_INPUTS)  # and drafts after it
    turboquant = TurboQuantCache("turboquant_k8v4", (True,) * len(kinds))
    heads, dim = _kv_shape(tiny_model_dir("qwen3"))
    tq_pool = pool_for(pool.layout, kinds, heads, dim, mx.float32, turboquant)
    assert step.takes(tq_pool, plain, NO_INPUTS)
    assert not step.takes(tq_pool, verifying, NO_INPUTS)


def test_compiled_steps_keep_the_aux_states_of_eager(tiny_model_dir):
    """An EAGLE-3 drafter's target (`StepInputs.aux`): its decode steps compile, and the trace
    returns the aux states the eager forward keeps."""
    model = tiny_model_dir("qwen3")
    layer_ids = (0, 1, 2)

    def run(step_fn):
        adapter, kinds, pool, tables, lens, first = _prefilled(model)
        kept = []

        def with_aux(pool, packed):
            aux = AuxHidden(layer_ids)
            hidden = step_fn(adapter, kinds)(pool, packed, aux)
            kept.append(aux.states)
            return hidden

        steps, written = _decode(adapter, kinds, pool, tables, lens, first, 5, with_aux)
        return steps, written, [np.array(a) for a in kept]

    def eager(adapter, kinds):
        return lambda pool, packed, aux: hidden_states(
            adapter, pool, kinds, packed, StepInputs(aux=aux)
        )

    traced: list[compiled.CompiledDecode] = []

    def compiled_step(adapter, kinds):
        if not traced:
            traced.append(compiled.CompiledDecode(adapter, kinds))
        return traced[0].hidden_states

    *want, want_aux = run(eager)
    *got, got_aux = run(compiled_step)
    assert traced[0].steps == STEPS
    _assert_same(tuple(got), tuple(want))
    assert got_aux[0].shape == (5, 1, 3 * _hidden_size(model))
    for a, b in zip(got_aux, want_aux, strict=True):
        np.testing.assert_allclose(a, b, rtol=5e-4, atol=5e-4)


def _hidden_size(model_dir) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]


OTHER_MODELS = {
    # MoE and KV-sharing layers (Gemma 4 MoE), two head sizes, shared KV layers and per-layer
    # inputs (Gemma 4 as E2B), MoE (Qwen3-MoE), sinks and MXFP4 experts (GPT-OSS), 4-bit weights
    "gemma4_moe": lambda request, tmp: request.getfixturevalue("tiny_gemma4_moe_dir"),
    "gemma4": lambda request, tmp: request.getfixturevalue("tiny_gemma4_dir"),
    "qwen3_moe": lambda request, tmp: _moe(tmp),
    "gpt_oss": lambda request, tmp: _gpt_oss(tmp),
    "llama_q4": lambda request, tmp: request.getfixturevalue("tiny_quantized_dir")("llama"),
}


def _moe(tmp):
    from tests.fixtures.tiny_moe import write_tiny_moe

    return write_tiny_moe(tmp / "moe", "qwen3_moe")


def _gpt_oss(tmp):
    from tests.fixtures.tiny_gpt_oss import write_tiny_gpt_oss

    return write_tiny_gpt_oss(tmp / "gpt-oss", mxfp4=True)


@pytest.mark.parametrize("name", list(OTHER_MODELS))
def test_other_decoders(request, tmp_path, name):
    model = OTHER_MODELS[name](request, tmp_path)
    adapter, kinds, pool, tables, lens, first = _prefilled(model)
    want = _decode(adapter, kinds, pool, tables, lens, first, 5, _eager(adapter, kinds))
    adapter, kinds, pool, tables, lens, first = _prefilled(model)
    step = compiled.CompiledDecode(adapter, kinds)
    got = _decode(adapter, kinds, pool, tables, lens, first, 5, step.hidden_states)
    _assert_same(got, want, tol=5e-3)  # experts and quantized weights: larger activations


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
# Not int4: a value on a rounding edge moves by a whole step of its row's 16 levels, and the
# rows attending to it visibly with it (its traced op: tests/ops/test_per_token_head_kv.py).
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8_per_token_head"])
def test_quantized_caches(tiny_model_dir, monkeypatch, reference_ops, kv_cache_dtype):
    """fp8 pools (bytes, per-layer scales) and per-token-head rows: compiled decode and
    verification steps write the same bytes and read them as eager ones, on the native ops and
    on MLX's own."""
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    model = tiny_model_dir("gemma2", sliding_window=24)
    for steps in (_decode, _verify):
        adapter, kinds, pool, tables, lens, first = _prefilled(model, kv_cache_dtype)
        assert pool.layer_quant is not None
        args = (first, 5) if steps is _decode else (5,)
        want = steps(adapter, kinds, pool, tables, lens, *args, _eager(adapter, kinds))
        adapter, kinds, pool, tables, lens, first = _prefilled(model, kv_cache_dtype)
        step = compiled.CompiledDecode(adapter, kinds)
        got = steps(adapter, kinds, pool, tables, lens, *args, step.hidden_states)
        assert step.steps == STEPS
        _assert_same(got, want, kv_cache_dtype=kv_cache_dtype)


# Multi-head latent attention (one latent row per token, `kv.latent`): GLM-4.7-Flash's layout
# (MLA with MoE), DeepSeek-V3's (query LoRA, grouped routing), DeepSeek-V2-Lite's (no query
# LoRA) and MiniCPM3's (dense).
MLA_MODELS = ["glm4_moe_lite", "deepseek_v3", "deepseek_v2_lite", "minicpm3"]


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize("name", MLA_MODELS)
def test_latent_attention_decoders(request, monkeypatch, name, reference_ops):
    """MLA decoders' decode and verification steps compile (the latent cache's write and its
    attention traced on the native ops, and on their batched pure-MLX versions, the GPU
    proxy's path): the same tokens, hidden states and latent rows as eager steps."""
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    model = request.getfixturevalue(f"tiny_{name}_dir")
    for steps in (_decode, _verify):
        adapter, kinds, pool, tables, lens, first = _prefilled(model)
        assert pool.latent and compiled.eager_reason(adapter, kinds, _Config()) is None
        args = (first, 5) if steps is _decode else (5,)
        want = steps(adapter, kinds, pool, tables, lens, *args, _eager(adapter, kinds))
        adapter, kinds, pool, tables, lens, first = _prefilled(model)
        step = compiled.CompiledDecode(adapter, kinds)
        got = steps(adapter, kinds, pool, tables, lens, *args, step.hidden_states)
        assert step.steps == STEPS and step.failed is None
        _assert_same(got, want, tol=5e-3)  # experts: larger activations


class _Config:
    """The parts of a vLLM config `eager_reason` reads, for a plain engine."""

    lora_config = None


class _LoRAConfig(_Config):
    lora_config = object()


def test_which_models_compile(tiny_model_dir, tiny_qwen3_5_dir, tiny_kimi_linear_dir):
    """Hybrids compile (their state pages traced, `kv.state.TracedBlocks`; their engines run
    compiled against transformers in test_hybrid.py, test_short_conv.py' and here below); LoRA
    keeps a model eager, by name."""
    for model in (tiny_qwen3_5_dir, tiny_kimi_linear_dir):  # GDN; KDA beside MLA
        adapter = load_model(str(model), compute_dtype=mx.float32)
        assert compiled.eager_reason(adapter, adapter.layer_kinds(), _Config()) is None
    adapter = load_model(str(tiny_model_dir("qwen3")), compute_dtype=mx.float32)
    got = compiled.eager_reason(adapter, adapter.layer_kinds(), _LoRAConfig())
    assert got is not None and "LoRA" in got, got


def test_buckets():
    sizes = range(200)
    buckets = sorted({compiled.bucket(n) for n in sizes})
    assert buckets[:12] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert all(n <= compiled.bucket(n) <= max(1, n * 3 // 2) for n in sizes)


# ------------------------------------------------------------------------------ the engine

MIXED = random_prompts(11, [1, 5, 17, 40, 75])
PREEMPTED = random_prompts(12, [48] * 5)
SHARED = random_prompts(13, [48])[0]
HITS = [SHARED + tail for tail in random_prompts(14, [3, 9])]
NEW_TOKENS = 24


@pytest.mark.slow
def test_engine_with_compiled_decode_matches_transformers(tiny_model_dir):
    """Gemma 2 (two KV-cache groups: sliding and full; soft-capped attention), async scheduling
    with steps pipelined (tokens carried on the device), 16-token chunks, a pool too small for
    the preempted batch, a prefix round."""
    model = tiny_model_dir("gemma2", sliding_window=24)
    engine = {
        "max_num_batched_tokens": 16,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": 20 * kv_block_bytes(model),
        "max_model_len": 256,
        "async_scheduling": True,
        "disable_log_stats": False,
    }
    jobs = [
        {"prompts": MIXED, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": PREEMPTED, "params": [greedy(40)]},
        {"prompts": [SHARED + [5]], "params": [greedy(4)]},
        {"prompts": HITS, "params": [greedy(NEW_TOKENS)]},
        {"action": "compiled_steps"},
        {"action": "carried_steps"},
    ]
    env = COMPILED_ENV
    (mixed, preempted, _, hits, steps, carried), metrics = run_engine_job(
        model, jobs, engine=engine, env=env, with_metrics=True
    )
    assert steps > 50, steps  # decode steps ran compiled
    # Greedy rounds without logprobs: the next step took each step's tokens on the device.
    assert carried > 40, carried
    assert metrics.get("vllm:num_preemptions", 0) > 0, metrics
    assert tokens_of(mixed) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert tokens_of(preempted) == hf_greedy(model, PREEMPTED, 40)
    assert tokens_of(hits) == hf_greedy(model, HITS, NEW_TOKENS)
    assert all(r["num_cached_tokens"] >= 32 for r in hits)
    for prompt, result in zip(MIXED, mixed):
        sample = result["outputs"][0]
        ref = hf_logprobs(model, prompt + sample["token_ids"])
        for step, token in enumerate(sample["token_ids"]):
            got = sample["logprobs"][step][str(token)]
            assert abs(got - ref[len(prompt) - 1 + step, token]) < 1e-3, (step, got)


def test_a_forward_that_cannot_be_traced_stays_eager(tiny_model_dir, monkeypatch):
    """A family whose forward reads a value on the host cannot be traced: the compiled step
    gives None, says why, and leaves the pool as it was; the step then runs eagerly."""
    adapter, kinds, pool, tables, lens, first = _prefilled(tiny_model_dir("qwen3"))
    forward = adapter.forward

    def reads_the_host(embeds, caches, **kwargs):
        float(embeds.sum())  # evaluates inside mx.compile
        return forward(embeds, caches, **kwargs)

    monkeypatch.setattr(adapter, "forward", reads_the_host)
    step = compiled.CompiledDecode(adapter, kinds)
    before = list(pool.keys)
    packed = decode_batch(["0"], lens[:1], first[:1], [tables[:1]], [BLOCK])
    assert step.hidden_states(pool, packed) is None
    assert "eval" in step.failed and step.steps == 0
    assert all(a is b for a, b in zip(pool.keys, before))
