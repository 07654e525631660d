"""The C++ CPU body of reshape_and_cache quantizes fp8 pools (kv_cache_dtype fp8_e4m3 / fp8_e5m2)
as vLLM's store rule says, checked against a float64 brute-force quantizer: nearest byte, ties to
the even mantissa, subnormals, saturation of overflows and infinities, NaN, per-pool scales, rows
of every float dtype, strided rows, padding slots; and the builder refuses pools it would misfill."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import DTYPES, to_numpy

from tests.fixtures.fp8_reference import exact_values, quantize64
from vllm_metal.ops.fp8 import FORMATS, KVQuant


def edge_values(name: str, rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` float32 values that visit every rounding case of the format: normals, subnormals,
    every finite value, exact midpoints between neighbours (ties), values past the largest
    finite one, infinities, zeros of both signs, NaN."""
    fmt = FORMATS[name]
    table = exact_values(name)
    finite = np.sort(table[np.isfinite(table)])
    special = [fmt.max_finite * 1.01, -fmt.max_finite * 5, np.inf, -np.inf, 0.0, -0.0, np.nan]
    pool = np.concatenate(
        [
            rng.standard_normal(count) * fmt.max_finite / 16,
            rng.standard_normal(count) * 2.0 ** (fmt.min_exponent - 1),  # subnormals
            finite,
            (finite[1:] + finite[:-1]) / 2,  # exact ties
            special,
        ]
    ).astype(np.float32)
    return rng.permutation(pool)[:count]


def same_values(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """Bytes that decode to the same values (so +0 and -0 agree); NaN only where NaN is stored."""
    table = exact_values(name)
    np.testing.assert_array_equal(table[got], table[want])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name,k_scale,v_scale", [("fp8_e4m3", 1.0, 0.25), ("fp8_e5m2", 3.0, 1.0)])
def test_cpu_body_quantizes_as_float64(
    native: ModuleType, dtype: str, name: str, k_scale: float, v_scale: float
) -> None:
    rng = np.random.default_rng(len(dtype) + int(k_scale))
    num_blocks, block_size, heads, dim = 6, 16, 2, 64
    num_tokens = 40
    n = num_tokens * heads * dim
    key = mx.array(
        (edge_values(name, rng, n) * np.float32(k_scale)).reshape(num_tokens, heads, dim)
    )
    value = mx.array(
        edge_values(name, rng, n).reshape(num_tokens, heads, dim) * np.float32(v_scale)
    )
    key, value = key.astype(DTYPES[dtype]), value.astype(DTYPES[dtype])
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int64)
    slots[[3, 11]] = -1  # padding
    start = rng.integers(0, 256, (num_blocks, block_size, heads, dim), dtype=np.uint8)
    kc, vc = native.reshape_and_cache(
        key,
        value,
        mx.array(start),
        mx.array(start),
        mx.array(slots),
        quant=KVQuant(FORMATS[name], k_scale, v_scale),
    )
    assert kc.dtype == vc.dtype == mx.uint8
    got_k, got_v = np.asarray(kc).reshape(-1, heads, dim), np.asarray(vc).reshape(-1, heads, dim)
    want_k, want_v = start.reshape(-1, heads, dim).copy(), start.reshape(-1, heads, dim).copy()
    rows_k, rows_v = to_numpy(key).astype(np.float64), to_numpy(value).astype(np.float64)
    written = slots >= 0
    want_k[slots[written]] = quantize64(rows_k[written], name, k_scale)
    want_v[slots[written]] = quantize64(rows_v[written], name, v_scale)
    same_values(got_k, want_k, name)
    same_values(got_v, want_v, name)
    nan_rows = np.isnan(rows_k[written])
    assert (got_k[slots[written]][nan_rows] == 0x7F).all()  # NaN stores the format's NaN byte
    assert np.isfinite(exact_values(name)[got_k[slots[written]][~nan_rows]]).all()  # saturated


def test_strided_rows_and_pool_slices(native: ModuleType) -> None:
    """Rows that are views of a fused QKV projection, written into a slice of a larger pool."""
    rng = np.random.default_rng(9)
    qkv = mx.array(rng.standard_normal((5, 8, 64)).astype(np.float32) * 30).astype(mx.float16)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    big = mx.zeros((2, 3, 16, 2, 64), mx.uint8)
    kc, vc = big[0], big[1]
    slots = np.array([0, 33, 47, -1, 20], np.int64)
    quant = KVQuant(FORMATS["fp8_e4m3"], 0.5, 2.0)
    got_k, got_v = native.reshape_and_cache(key, value, kc, vc, mx.array(slots), quant=quant)
    for got, rows, scale in ((got_k, key, 0.5), (got_v, value, 2.0)):
        flat = np.asarray(got).reshape(-1, 2, 64)
        for t, slot in enumerate(slots):
            if slot >= 0:
                want = quantize64(to_numpy(rows[t]).astype(np.float64), "fp8_e4m3", scale)
                same_values(flat[slot], want, "fp8_e4m3")
        untouched = np.setdiff1d(np.arange(flat.shape[0]), slots[slots >= 0])
        assert (flat[untouched] == 0).all()


def test_the_builder_refuses_pools_it_would_misfill(native: ModuleType) -> None:
    """Float rows into uint8 pools without an fp8 kv_cache_dtype, or into float pools with one,
    would write bytes as floats (or floats as bytes): the C++ builder refuses both."""
    from vllm_metal import _C

    rows = mx.ones((2, 2, 64), mx.float32)
    byte_pool = mx.zeros((2, 16, 2, 64), mx.uint8)
    float_pool = mx.zeros((2, 16, 2, 64), mx.float32)
    slots = mx.array(np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match="rows' dtype"):
        _C.reshape_and_cache(rows, rows, byte_pool, byte_pool, slots)
    with pytest.raises(ValueError, match="rows' dtype"):
        _C.reshape_and_cache(rows, rows, float_pool, float_pool, slots, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _C.reshape_and_cache(rows, rows, byte_pool, byte_pool, slots, kv_cache_dtype="fp8")
