"""fp8 KV caches (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2): the byte formats, the quantizing cache
write and the dequantizing attention agree with a float64 quantize -> dequantize reference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import assert_close, make_batch, to_numpy
from test_reference_ops import naive_attention

from tests.fixtures.fp8_reference import dequantize64, exact_values, quantize64
from vllm_metal import ops
from vllm_metal.ops import _native, fp8
from vllm_metal.ops.attention import batched, reference

FORMATS = ["fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("name", FORMATS)
def test_decode_table_is_the_spec(name: str) -> None:
    np.testing.assert_array_equal(fp8.decode_table(fp8.FORMATS[name]), exact_values(name))
    assert fp8.FORMATS[name].max_finite == np.nanmax(
        exact_values(name)[np.isfinite(exact_values(name))]
    )


@pytest.mark.parametrize("scale", [1.0, 0.25, 3.0])
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_matches_float64(name: str, scale: float) -> None:
    fmt = fp8.FORMATS[name]
    table = exact_values(name)
    finite = np.sort(table[np.isfinite(table)])
    rng = np.random.default_rng(7)
    x = (
        np.concatenate(
            [
                rng.standard_normal(4000) * fmt.max_finite / 16,
                rng.standard_normal(4000) * 2.0 ** (fmt.min_exponent - 1),  # subnormals
                finite,
                (finite[1:] + finite[:-1]) / 2,  # exact ties
                [fmt.max_finite * 1.01, -fmt.max_finite * 5, np.inf, -np.inf, 0.0, np.nan],
            ]
        ).astype(np.float32)
        * np.float32(scale)
    )
    got = np.asarray(fp8.quantize(mx.array(x), fmt, scale))
    want = quantize64(x, name, scale)
    np.testing.assert_array_equal(table[got], table[want])
    assert np.isfinite(table[got][~np.isnan(x)]).all()  # saturated, never Inf
    back = np.asarray(fp8.dequantize(mx.array(got), fmt, scale, mx.float32))
    np.testing.assert_array_equal(back, dequantize64(want, name, scale).astype(np.float32))


def fp8_pools(batch, name: str, k_scale: float, v_scale: float):
    """The batch's float pools stored as fp8 bytes (NaN bytes where the float pools are NaN)."""
    k = quantize64(to_numpy(batch.key_cache), name, k_scale)
    v = quantize64(to_numpy(batch.value_cache), name, v_scale)
    return mx.array(k), mx.array(v)


CASES = {
    "decode": {"q_lens": [1, 1, 1], "ctx_lens": [5, 33, 64]},
    "mixed": {"q_lens": [1, 7, batched.TILE + 3, 0], "ctx_lens": [9, 20, 90, 4]},
    "padding": {"q_lens": [3, 1], "ctx_lens": [3, 40], "extra_tokens": 2},
}
OPTIONS = {
    "causal": {},
    "window": {"sliding_window": 5},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "name,dtype,scales",
    [
        ("fp8", "float32", (1.0, 1.0)),
        ("fp8_e4m3", "bfloat16", (0.5, 2.0)),
        ("fp8_e5m2", "float32", (2.0, 0.25)),
    ],
)
def test_attention_reads_fp8(name, dtype, scales, case, option) -> None:
    rng = np.random.default_rng(len(case) + 3 * len(option))
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, **CASES[case]
    )
    k_scale, v_scale = scales
    kc, vc = fp8_pools(batch, fp8.KV_CACHE_DTYPES[name], k_scale, v_scale)
    kwargs = dict(OPTIONS[option])
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
    args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    quant = {"kv_cache_dtype": name, "k_scale": k_scale, "v_scale": v_scale}
    got = ops.paged_attention(*args, scale=0.125, **quant, **kwargs)
    assert got.dtype == batch.query.dtype
    fmt_name = fp8.KV_CACHE_DTYPES[name]
    sinks = kwargs.get("sinks")
    want = naive_attention(
        to_numpy(batch.query),
        dequantize64(np.asarray(kc), fmt_name, k_scale),
        dequantize64(np.asarray(vc), fmt_name, v_scale),
        np.asarray(batch.block_tables),
        np.asarray(batch.seq_lens),
        np.asarray(batch.cu_seqlens_q),
        scale=0.125,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=None if sinks is None else np.asarray(sinks),
    )
    assert_close(got, mx.array(want.astype(np.float32)), dtype)
    # The per-sequence reference and the batched MLX op (a GPU's path) read the bytes the same way.
    for impl in (reference, batched):
        ref = impl.paged_attention(*args, scale=0.125, quant=fp8.kv_quant(**quant), **kwargs)
        assert_close(ref, mx.array(want.astype(np.float32)), dtype)


def test_key_ends_rows_read_fp8() -> None:
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng, q_lens=[6], ctx_lens=[10], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    kc, vc = fp8_pools(batch, "fp8_e4m3", 0.5, 0.5)
    key_ends = np.array([0, 0, 9, 9, 9, 0])
    args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    quant = {"kv_cache_dtype": "fp8_e4m3", "k_scale": 0.5, "v_scale": 0.5}
    got = ops.paged_attention(*args, scale=0.125, key_ends=key_ends, **quant)
    want = naive_attention(
        to_numpy(batch.query),
        dequantize64(np.asarray(kc), "fp8_e4m3", 0.5),
        dequantize64(np.asarray(vc), "fp8_e4m3", 0.5),
        *(np.asarray(a) for a in args[3:]),
        scale=0.125,
        sliding_window=None,
        softcap=None,
        sinks=None,
        key_ends=key_ends,
    )
    assert_close(got, mx.array(want.astype(np.float32)), "float32")


@pytest.mark.parametrize("name", FORMATS)
def test_cache_write_stores_fp8_bytes(name: str) -> None:
    rng = np.random.default_rng(11)
    num_blocks, block_size, heads, dim = 4, 16, 2, 64
    key = rng.standard_normal((5, heads, dim)).astype(np.float32) * 40
    value = rng.standard_normal((5, heads, dim)).astype(np.float32)
    slots = np.array([3, -1, 17, 40, 63], np.int64)
    start = rng.integers(0, 256, (num_blocks, block_size, heads, dim), dtype=np.uint8)
    kc, vc = ops.reshape_and_cache(
        mx.array(key).astype(mx.bfloat16),
        mx.array(value).astype(mx.bfloat16),
        mx.array(start),
        mx.array(start),
        mx.array(slots),
        kv_cache_dtype=name,
        k_scale=2.0,
        v_scale=0.5,
    )
    want_k = start.reshape(-1, heads, dim).copy()
    want_v = want_k.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot] = quantize64(to_numpy(mx.array(key[t]).astype(mx.bfloat16)), name, 2.0)
            want_v[slot] = quantize64(to_numpy(mx.array(value[t]).astype(mx.bfloat16)), name, 0.5)
    assert kc.dtype == mx.uint8
    np.testing.assert_array_equal(np.asarray(kc).reshape(-1, heads, dim), want_k)
    np.testing.assert_array_equal(np.asarray(vc).reshape(-1, heads, dim), want_v)


def test_fp8_writes_take_the_native_op_where_there_is_one(monkeypatch) -> None:
    """The native cache write quantizes fp8 rows itself; where no native op runs (no extension, a
    GPU without kernels) MLX's own ops quantize and scatter, to the same bytes."""
    from vllm_metal.ops import _backend

    calls = []
    real = _native.reshape_and_cache

    def counted(*args, **kwargs):
        calls.append(kwargs.get("quant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_native, "reshape_and_cache", counted)
    rng = np.random.default_rng(4)
    rows = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32) * 100).astype(mx.bfloat16)
    slots = mx.array(np.array([0, 17, -1], np.int64))
    pools = []
    for _ in range(2):
        kc, vc = mx.zeros((2, 16, 2, 64), mx.uint8), mx.zeros((2, 16, 2, 64), mx.uint8)
        kc, vc = ops.reshape_and_cache(rows, rows, kc, vc, slots, kv_cache_dtype="fp8", v_scale=0.5)
        pools.append((np.asarray(kc), np.asarray(vc)))
        monkeypatch.setattr(_backend, "native_for", lambda *a, **k: None)
    assert len(calls) == 1 and calls[0].fmt.name == "fp8_e4m3" and calls[0].v_scale == 0.5
    np.testing.assert_array_equal(pools[0][0], pools[1][0])
    np.testing.assert_array_equal(pools[0][1], pools[1][1])
    want = quantize64(to_numpy(rows[1]), "fp8_e4m3", 1.0)  # slot 17: block 1, offset 1
    np.testing.assert_array_equal(
        exact_values("fp8_e4m3")[pools[0][0][1, 1]], exact_values("fp8_e4m3")[want]
    )


def test_fp8_arguments_are_checked() -> None:
    rng = np.random.default_rng(1)
    batch = make_batch(
        rng, q_lens=[1], ctx_lens=[4], num_heads=2, num_kv_heads=2, head_size=64, block_size=16
    )
    kc, vc = fp8_pools(batch, "fp8_e4m3", 1.0, 1.0)
    index = batch.args[3:]
    with pytest.raises(ValueError, match="key_cache must be one of"):
        ops.paged_attention(batch.query, kc, vc, *index, scale=0.1)  # bytes read as floats
    with pytest.raises(ValueError, match="must be uint8"):
        ops.paged_attention(*batch.args, scale=0.1, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ops.paged_attention(batch.query, kc, vc, *index, scale=0.1, kv_cache_dtype="nvfp4")
    with pytest.raises(ValueError, match="k_scale"):
        ops.paged_attention(
            batch.query, kc, vc, *index, scale=0.1, kv_cache_dtype="fp8", k_scale=0.0
        )
    rows = batch.query
    with pytest.raises(ValueError, match="v_scale"):
        ops.reshape_and_cache(
            rows,
            rows,
            kc,
            vc,
            mx.array(np.array([0], np.int64)),
            kv_cache_dtype="fp8",
            v_scale=float("inf"),
        )
    with pytest.raises(ValueError, match="key must be one of"):
        ops.reshape_and_cache(kc[0], vc[0], kc, vc, mx.zeros((16,), mx.int64), kv_cache_dtype="fp8")
