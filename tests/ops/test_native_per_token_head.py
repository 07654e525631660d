"""The native ops (C++ CPU bodies here) over int8 / fp8 / int4_per_token_head pools: the cache
write stores vLLM's rows byte for byte and attention reads them as a float64 attention over the
port's dequantized rows (tests/fixtures/per_token_head_reference.py), including split-KV and
strided queries (int4: the op takes rows and queries already rotated, as the public ops hand them
over); the public ops send these pools to the native op unless VLLM_METAL_USE_REFERENCE_OPS=1."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import assert_close, make_batch, to_numpy
from test_per_token_head_kv import _rows, _stored_pools
from test_reference_ops import naive_attention

from tests.fixtures import per_token_head_reference as ref
from vllm_metal import ops
from vllm_metal.ops import per_token_head as ptk
from vllm_metal.ops.attention import batched

FORMATS = list(ptk.NATIVE_KV_CACHE_DTYPES)
INT4 = "int4_per_token_head"


def _write_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """`_rows` and two rows of int4 ties: levels and a zero point halfway between two integers
    (range 15, so scale 1)."""
    x = _rows(rng, shape)
    flat = x.reshape(-1, shape[-1])
    flat[3] = (np.arange(shape[-1]) % 14) + 0.5
    flat[3, :2] = [0.0, 15.0]
    flat[4] = flat[3] - 2.5  # zero point 2.5: rounds to 3
    return x


def _stored(x: np.ndarray, name: str) -> np.ndarray:
    """The port's bytes of rows as the native write receives them (int4: already rotated)."""
    if name == INT4:
        return ref.pack_row(*ref.store_int4(x), name)
    return ref.quantize_rows(x, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", FORMATS)
def test_native_cache_write_stores_vllms_rows(native, name: str, dtype: str) -> None:
    rng = np.random.default_rng(11)
    num_blocks, block_size, heads, dim = 4, 16, 3, 96
    width = ptk.row_bytes(name, dim)
    rows = _write_rows(rng, (2, 9, heads, dim))
    key = mx.array(rows[0]).astype(getattr(mx, dtype))
    value = mx.array(rows[1]).astype(getattr(mx, dtype))[:, ::-1]  # a strided view
    slots = np.array([3, -1, 17, 40, 63, 0, 64, 22, 5], np.int64)  # padding, out of range
    start = rng.integers(0, 256, (num_blocks, block_size, heads, width), dtype=np.uint8)
    kc, vc = native._C.reshape_and_cache(
        key, value, mx.array(start), mx.array(start), mx.array(slots), kv_cache_dtype=name
    )
    for got, x in ((kc, key), (vc, value)):
        want = start.reshape(-1, heads, width).copy()
        kept = (slots >= 0) & (slots < num_blocks * block_size)
        want[slots[kept]] = _stored(to_numpy(x)[kept].astype(np.float64), name)
        np.testing.assert_array_equal(np.asarray(got).reshape(-1, heads, width), want)


CASES = {
    "decode": {"q_lens": [1, 1, 1], "ctx_lens": [5, 33, 64]},
    "mixed": {"q_lens": [1, 7, 40, 0], "ctx_lens": [9, 20, 90, 4]},
    "long": {"q_lens": [1, 3], "ctx_lens": [700, 560]},  # the driver splits the key range
}
OPTIONS = {
    "causal": {},
    "window+sinks": {"sliding_window": 37, "sinks": True},
    "softcap": {"softcap": 5.0},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name,dtype", [(FORMATS[0], "float32"), (FORMATS[1], "float32"),
                                        (FORMATS[0], "bfloat16"), (FORMATS[1], "float16"),
                                        (INT4, "float32"), (INT4, "bfloat16")])  # fmt: skip
def test_native_attention_reads_vllms_values(native, name, dtype, case, option) -> None:
    rng = np.random.default_rng(len(case) * 7 + len(option))
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, **CASES[case]
    )
    kc, vc, keys, values = _stored_pools(batch, name)
    kwargs = dict(OPTIONS[option])
    sinks = None
    if kwargs.pop("sinks", False):
        sinks = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
    query, scale = batch.query, 0.125
    if name == INT4:  # the op reads the rotated space: rotated query, scale / b, rotated values
        rotated = ref.round_to(ref.rotate(to_numpy(query)), query.dtype)
        query = mx.array(rotated.astype(np.float32)).astype(query.dtype)
        scale /= 64
        keys, values = (ref.dequantize_rows(np.asarray(c), name) for c in (kc, vc))
    args = (query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    got = native._C.paged_attention(*args, scale=scale, sinks=sinks, kv_cache_dtype=name, **kwargs)
    want = naive_attention(
        to_numpy(query), keys, values, *(np.asarray(a) for a in args[3:]), scale=scale,
        sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"),
        sinks=None if sinks is None else np.asarray(sinks),
    )  # fmt: skip
    assert got.dtype == query.dtype
    assert_close(got, mx.array(want.astype(np.float32)), dtype)


def test_native_attention_single_thread_and_strided_query(native) -> None:
    """One thread (no splits, no head split) and a query that is a view of a fused QKV buffer."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng, q_lens=[1, 5], ctx_lens=[300, 40], num_heads=4, num_kv_heads=2, head_size=64,
        block_size=16,
    )  # fmt: skip
    kc, vc, keys, values = _stored_pools(batch, "int8_per_token_head")
    fused = mx.concatenate([batch.query, batch.query[:, :2] * 0 + 7.0], axis=1)
    query = fused[:, :4]
    args = (query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    native.set_num_threads(1)
    try:
        got = native._C.paged_attention(*args, scale=0.125, kv_cache_dtype="int8_per_token_head")
        mx.eval(got)
    finally:
        native.set_num_threads(0)
    want = naive_attention(
        to_numpy(batch.query), keys, values, *(np.asarray(a) for a in args[3:]), scale=0.125,
        sliding_window=None, softcap=None, sinks=None,
    )  # fmt: skip
    assert_close(got, mx.array(want.astype(np.float32)), "float32")


def test_the_native_builders_refuse_bytes_as_floats(native) -> None:
    """A uint8 pool given as 'auto' is refused, so the bytes are never read as floats."""
    rng = np.random.default_rng(6)
    batch = make_batch(
        rng, q_lens=[1], ctx_lens=[4], num_heads=2, num_kv_heads=2, head_size=64, block_size=16
    )
    for name in FORMATS:
        kc, vc, *_ = _stored_pools(batch, name)
        with pytest.raises(ValueError, match="uint8"):
            mx.eval(native._C.paged_attention(batch.query, kc, vc, *batch.args[3:], scale=0.1))


@pytest.mark.parametrize("name", FORMATS)
def test_the_public_ops_run_the_native_op(native, monkeypatch, name: str) -> None:
    """ops.* give exactly the native op's result (its float32 order differs from MLX's ops, so the
    two paths are told apart), and MLX's ops with VLLM_METAL_USE_REFERENCE_OPS=1. int4: the public
    ops rotate the rows and the query in MLX, call the native op with scale / b and rotate its
    output back; its native write gives MLX's bytes."""
    rng = np.random.default_rng(9)
    batch = make_batch(
        rng, q_lens=[1, 6], ctx_lens=[70, 30], num_heads=4, num_kv_heads=2, head_size=64,
        block_size=16,
    )  # fmt: skip
    rows = mx.array(_rows(rng, (4, 2, 64)))
    pool = mx.zeros((8, 16, 2, ptk.row_bytes(name, 64)), mx.uint8)
    slots = mx.array(np.array([0, 5, -1, 100], np.int64))
    kc, vc, *_ = _stored_pools(batch, name)
    args = (batch.query, kc, vc, *batch.args[3:])
    quant = ptk.kv_quant(name)
    query, scale = batch.query, 0.125
    if quant.rotated:
        query, scale = ptk.rotate(query).astype(query.dtype), scale / 64
    want_attn = native._C.paged_attention(query, *args[1:], scale=scale, kv_cache_dtype=name)
    mlx_attn = batched.paged_attention(query, *args[1:], scale=scale, quant=quant)
    if quant.rotated:
        want_attn, mlx_attn = (ptk.rotate(o, inverse=True) / 64 for o in (want_attn, mlx_attn))
    stored = quant.stored_rows(rows)
    want_k, _ = native._C.reshape_and_cache(stored, stored, pool, mx.array(pool), slots,
                                            kv_cache_dtype=name)  # fmt: skip
    assert (np.asarray(want_attn) != np.asarray(mlx_attn)).any(), "paths must differ in order"
    got = ops.paged_attention(*args, scale=0.125, kv_cache_dtype=name)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want_attn))
    got_k, _ = ops.reshape_and_cache(rows, rows, mx.zeros_like(pool), mx.zeros_like(pool), slots,
                                     kv_cache_dtype=name)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    flat = np.asarray(want_k).reshape(-1, 2, pool.shape[-1])
    np.testing.assert_array_equal(flat[[0, 5]], np.asarray(quant.quantize(rows))[:2])
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    got = ops.paged_attention(*args, scale=0.125, kv_cache_dtype=name)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(mlx_attn))


@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_the_public_int4_ops_attend_in_the_original_space(native, case: str) -> None:
    """ops.paged_attention over int4 pools (native op inside, the rotations in MLX around it) is a
    float64 attention over the port's rows rotated back: the query rotated as the rows were, the
    scale divided by the rotation block, the output rotated back."""
    rng = np.random.default_rng(21)
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=96, block_size=16, **CASES[case]
    )  # fmt: skip
    kc, vc, keys, values = _stored_pools(batch, INT4)
    args = (batch.query, kc, vc, *batch.args[3:])
    got = ops.paged_attention(*args, scale=0.1, kv_cache_dtype=INT4)
    want = naive_attention(
        to_numpy(batch.query), keys, values, *(np.asarray(a) for a in args[3:]), scale=0.1,
        sliding_window=None, softcap=None, sinks=None,
    )  # fmt: skip
    assert_close(got, mx.array(want.astype(np.float32)), "float32")


def test_native_int4_one_key_reads_its_row_exactly(native) -> None:
    """One key per sequence: the output is its value row, `(level - zp) * scale'` to the bit in
    float32 (a scale read with the zero point left in its low bits is off by a few ulps)."""
    rng = np.random.default_rng(8)
    batch = make_batch(
        rng, q_lens=[1, 1], ctx_lens=[1, 1], num_heads=4, num_kv_heads=2, head_size=64,
        block_size=16,
    )  # fmt: skip
    kc, vc, *_ = _stored_pools(batch, INT4)
    got = native._C.paged_attention(batch.query, kc, vc, *batch.args[3:], scale=0.1,
                                    kv_cache_dtype=INT4)  # fmt: skip
    values = ref.dequantize_rows(np.asarray(vc), INT4).astype(np.float32)
    rows = values[np.asarray(batch.block_tables)[:, 0], 0]
    np.testing.assert_array_equal(np.asarray(got), np.repeat(rows, 2, axis=1))


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_every_cpu_kernel_build_reads_int4(native, isa: str) -> None:
    """Each inner-kernel build's nibble loads (vector and scalar tails: head size 80) read the
    port's levels."""
    if not native.set_cpu_isa(isa):
        pytest.skip(f"this CPU/build has no {isa} variant")
    try:
        rng = np.random.default_rng(31)
        batch = make_batch(
            rng, q_lens=[1, 9], ctx_lens=[70, 40], num_heads=4, num_kv_heads=2, head_size=80,
            block_size=16,
        )  # fmt: skip
        kc, vc, *_ = _stored_pools(batch, INT4)
        keys, values = (ref.dequantize_rows(np.asarray(c), INT4) for c in (kc, vc))
        args = (batch.query, kc, vc, *batch.args[3:])
        got = native._C.paged_attention(*args, scale=0.1, kv_cache_dtype=INT4)
        want = naive_attention(
            to_numpy(batch.query), keys, values, *(np.asarray(a) for a in args[3:]), scale=0.1,
            sliding_window=None, softcap=None, sinks=None,
        )  # fmt: skip
        assert_close(got, mx.array(want.astype(np.float32)), "float32")
    finally:
        native.set_cpu_isa("auto")
