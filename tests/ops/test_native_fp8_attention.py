"""The C++ CPU body of paged_attention reads fp8 pools (kv_cache_dtype fp8_e4m3 / fp8_e5m2) as a
float64 quantize -> dequantize reference says, in every inner-kernel build (generic, AVX2, AVX-512),
through split-KV merges, windows, soft-capping and sinks; ops.paged_attention hands fp8 pools to
the native op wherever one runs (the Metal kernels read them too: tests/msl)."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import assert_close, make_batch, to_numpy
from test_reference_ops import naive_attention

from tests.fixtures.fp8_reference import dequantize64, quantize64
from vllm_metal import ops
from vllm_metal.ops import _native
from vllm_metal.ops.fp8 import FORMATS, KVQuant

CASES = {
    "decode": {"q_lens": [1, 1, 1], "ctx_lens": [5, 33, 64]},
    "mixed": {"q_lens": [1, 7, 70, 0], "ctx_lens": [9, 20, 90, 4]},
    "padding": {"q_lens": [3, 1], "ctx_lens": [3, 40], "extra_tokens": 2},
}
OPTIONS = {
    "causal": {},
    "window": {"sliding_window": 5},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
}
STORAGE = {
    "e4m3": ("fp8_e4m3", "float32", 0.5, 2.0),
    "e5m2": ("fp8_e5m2", "bfloat16", 2.0, 0.25),
}


def _run(native: ModuleType, batch, fmt: str, k_scale: float, v_scale: float, dtype: str, **kw):
    """The native op and the float64 reference on the batch's pools stored as fp8."""
    kc = mx.array(quantize64(to_numpy(batch.key_cache), fmt, k_scale))
    vc = mx.array(quantize64(to_numpy(batch.value_cache), fmt, v_scale))
    args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    quant = KVQuant(FORMATS[fmt], k_scale, v_scale)
    got = native.paged_attention(*args, scale=0.125, quant=quant, **kw)
    sinks = kw.get("sinks")
    want = naive_attention(
        to_numpy(batch.query),
        dequantize64(np.asarray(kc), fmt, k_scale),
        dequantize64(np.asarray(vc), fmt, v_scale),
        *(np.asarray(a) for a in args[3:]),
        scale=0.125,
        sliding_window=kw.get("sliding_window"),
        softcap=kw.get("softcap"),
        sinks=None if sinks is None else np.asarray(sinks),
    )
    assert got.dtype == batch.query.dtype
    assert_close(got, mx.array(want.astype(np.float32)), dtype)
    return got, args, quant


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_cpu_body_reads_fp8(native: ModuleType, case: str, option: str, storage: str) -> None:
    fmt, dtype, k_scale, v_scale = STORAGE[storage]
    rng = np.random.default_rng(len(case) * 5 + len(option))
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, **CASES[case]
    )
    kw = dict(OPTIONS[option])
    if kw.pop("sinks", False):
        kw["sinks"] = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
    _run(native, batch, fmt, k_scale, v_scale, dtype, **kw)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("storage", STORAGE)
def test_every_cpu_kernel_build_reads_fp8(native: ModuleType, isa: str, storage: str) -> None:
    if not native.set_cpu_isa(isa):
        pytest.skip(f"this CPU/build has no {isa} variant")
    try:
        fmt, dtype, k_scale, v_scale = STORAGE[storage]
        rng = np.random.default_rng(21)
        batch = make_batch(
            rng,
            q_lens=[1, 1, 9],
            ctx_lens=[70, 3, 40],
            num_heads=8,
            num_kv_heads=2,
            head_size=80,  # not a multiple of every vector width: the scalar tails too
            block_size=16,
            dtype=dtype,
            query_scale=2.0,
        )
        sinks = mx.array(rng.standard_normal(8).astype(np.float32))
        _run(
            native,
            batch,
            fmt,
            k_scale,
            v_scale,
            dtype,
            sliding_window=24,
            softcap=10.0,
            sinks=sinks,
        )
        _run(native, batch, fmt, k_scale, v_scale, dtype)
    finally:
        native.set_cpu_isa("auto")


@pytest.mark.parametrize("storage", STORAGE)
def test_split_key_ranges_merge_scaled_values(native: ModuleType, storage: str) -> None:
    # Few work items over long key ranges: with 2 threads the key ranges are split and merged.
    native.set_num_threads(2)
    try:
        fmt, dtype, k_scale, v_scale = STORAGE[storage]
        rng = np.random.default_rng(16)
        batch = make_batch(
            rng,
            q_lens=[1, 3],
            ctx_lens=[3000, 1200],
            num_heads=2,
            num_kv_heads=1,
            head_size=64,
            block_size=32,
            dtype=dtype,
        )
        sinks = mx.array(np.array([0.5, -1.0], np.float32))
        _run(native, batch, fmt, k_scale, v_scale, dtype, sinks=sinks)
    finally:
        native.set_num_threads(0)


def test_fp8_goes_native_wherever_a_native_op_runs(native, monkeypatch) -> None:
    """ops.paged_attention hands fp8 pools to the native op (the C++ body here, the Metal kernels
    on a Mac); where no native op runs (a GPU without kernels) MLX's own ops read them."""
    from vllm_metal.ops import _backend

    rng = np.random.default_rng(5)
    batch = make_batch(
        rng,
        q_lens=[1, 3],
        ctx_lens=[9, 3],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
    )
    kc = mx.array(quantize64(to_numpy(batch.key_cache), "fp8_e4m3", 1.0))
    vc = mx.array(quantize64(to_numpy(batch.value_cache), "fp8_e4m3", 1.0))
    args = (batch.query, kc, vc, *batch.args[3:])
    calls = []
    real = _native.paged_attention

    def counted(*a, **kw):
        calls.append(kw.get("quant"))
        return real(*a, **kw)

    monkeypatch.setattr(_native, "paged_attention", counted)
    on_cpu = ops.paged_attention(*args, scale=0.1, kv_cache_dtype="fp8")
    assert len(calls) == 1 and calls[0].fmt.name == "fp8_e4m3"
    monkeypatch.setattr(_backend, "native_for", lambda *a, **k: None)  # as MLX's CUDA backend
    without_native = ops.paged_attention(*args, scale=0.1, kv_cache_dtype="fp8")
    assert len(calls) == 1
    assert_close(without_native, on_cpu, "float32")


def test_the_builder_refuses_pools_it_would_misread(native: ModuleType) -> None:
    """The C++ builder (CPU body and Metal kernels alike) refuses pools that are neither the
    query's dtype nor uint8 with an fp8 kv_cache_dtype, so bytes are never read as floats."""
    from vllm_metal import _C

    rng = np.random.default_rng(2)
    batch = make_batch(
        rng, q_lens=[1], ctx_lens=[4], num_heads=2, num_kv_heads=2, head_size=64, block_size=16
    )
    kc = mx.array(quantize64(to_numpy(batch.key_cache), "fp8_e4m3", 1.0))
    index = batch.args[3:]
    with pytest.raises(ValueError, match="query's dtype"):
        _C.paged_attention(batch.query, kc, kc, *index, scale=0.1)
    with pytest.raises(ValueError, match="query's dtype"):
        _C.paged_attention(batch.query.astype(mx.bfloat16), *batch.args[1:], scale=0.1)
    with pytest.raises(ValueError, match="query's dtype"):
        _C.paged_attention(*batch.args, scale=0.1, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _C.paged_attention(batch.query, kc, kc, *index, scale=0.1, kv_cache_dtype="fp8")
