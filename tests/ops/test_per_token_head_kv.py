"""Per-token-head KV caches (int8 / fp8 / int4_per_token_head): the stored rows, the cache write
and the attention read agree with a float64 port of vLLM's store and read rules
(tests/fixtures/per_token_head_reference.py), and planted bugs in the format are caught."""

from __future__ import annotations

import functools
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from paged_batch import assert_close, make_batch, to_numpy
from test_reference_ops import naive_attention

from tests.fixtures import per_token_head_reference as ref
from vllm_metal import ops
from vllm_metal.ops import per_token_head as ptk
from vllm_metal.ops.attention import batched, reference

FORMATS = list(ptk.KV_CACHE_DTYPES)


def _rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Rows of varied magnitude: gaussian, a few outliers, an all-zero row, a constant row, and a
    row of int8 ties (scale 1: every element lands halfway between two levels)."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 4, shape[:-1] + (1,)))
    x[..., 3] *= 50.0  # an outlier channel
    flat = x.reshape(-1, shape[-1])
    flat[0] = 0.0
    flat[1] = -2.5
    flat[2] = (np.arange(shape[-1]) % 21 - 10) + 0.5
    flat[2, 0] = 127.0
    return x.astype(np.float32)


def test_the_rotation_is_vllms() -> None:
    """int4's rotation, bit for bit: vLLM's own `single_rht` (its CPU path) and the port."""
    from vllm.v1.attention.ops.int4_per_token_head import single_rht

    rng = np.random.default_rng(0)
    for d in (64, 128, 96):
        x = rng.standard_normal((5, 3, d)).astype(np.float32)
        for inverse in (False, True):
            got = np.asarray(ptk.rotate(mx.array(x), inverse=inverse))
            vllm = single_rht(torch.from_numpy(x), inverse=inverse).numpy()
            np.testing.assert_array_equal(got, vllm)
            np.testing.assert_array_equal(got, ref.rotate(x, inverse=inverse).astype(np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", FORMATS)
def test_stored_rows_are_vllms(name: str, dtype: str) -> None:
    rng = np.random.default_rng(1)
    x = mx.array(_rows(rng, (64, 4, 128))).astype(getattr(mx, dtype))
    got = np.asarray(ptk.quantize(x, name))
    want = ref.quantize_rows(to_numpy(x), name, getattr(mx, dtype))
    assert got.shape == (64, 4, ptk.row_bytes(name, 128)) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)
    # The read: the port's float64 values, rounded once to the asked dtype.
    back = np.asarray(ptk.dequantize(mx.array(want), name, mx.float32))
    np.testing.assert_array_equal(back, ref.dequantize_rows(want, name).astype(np.float32))


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_error_is_the_formats(name: str) -> None:
    """Within half a step of the row's scale (int8, int4) or E4M3's relative precision (fp8)."""
    rng = np.random.default_rng(2)
    x = _rows(rng, (32, 2, 64)).astype(np.float64)
    stored = ref.quantize_rows(x, name)
    _, bits = ref.unpack_row(stored, name)
    back = ref.dequantize_rows(stored, name)
    if name == "int4_per_token_head":
        back = ref.rotate(back, inverse=True) / 64
        step = ref._from_bits(bits & np.uint32(0xFFFFFFF0))[..., None]
        bound = 0.5 * step * 64 / 8 + 1e-5  # |x - x'| <= ||error in rotated space|| / 8
    elif name == "int8_per_token_head":
        bound = 0.5 * ref._from_bits(bits)[..., None] * 1.0001 + 1e-12
    else:
        bound = np.abs(x) / 16 + ref._from_bits(bits)[..., None] * 2.0**-9
    assert (np.abs(back - x) <= bound).all()
    zero_row = stored.reshape(-1, stored.shape[-1])[0]
    assert not ref.dequantize_rows(zero_row, name).any()  # a zero row stays zero


@pytest.mark.parametrize("name", FORMATS)
def test_cache_write_stores_vllms_rows(name: str) -> None:
    rng = np.random.default_rng(3)
    num_blocks, block_size, heads, dim = 4, 16, 2, 64
    width = ptk.row_bytes(name, dim)
    key = mx.array(_rows(rng, (5, heads, dim))).astype(mx.bfloat16)
    value = mx.array(_rows(rng, (5, heads, dim))).astype(mx.bfloat16)
    slots = np.array([3, -1, 17, 40, 63], np.int64)
    start = rng.integers(0, 256, (num_blocks, block_size, heads, width), dtype=np.uint8)
    kc, vc = ops.reshape_and_cache(
        key, value, mx.array(start), mx.array(start), mx.array(slots), kv_cache_dtype=name
    )
    want_k = start.reshape(-1, heads, width).copy()
    want_v = want_k.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot] = ref.quantize_rows(to_numpy(key[t]), name, mx.bfloat16)
            want_v[slot] = ref.quantize_rows(to_numpy(value[t]), name, mx.bfloat16)
    np.testing.assert_array_equal(np.asarray(kc).reshape(-1, heads, width), want_k)
    np.testing.assert_array_equal(np.asarray(vc).reshape(-1, heads, width), want_v)


def _stored_pools(batch, name: str) -> tuple[mx.array, mx.array, np.ndarray, np.ndarray]:
    """The batch's float pools stored in `name` by the port (NaN rows: zero bytes) and what the
    port reads back (int4: rotated back to the original space, float64)."""
    out = []
    for pool in (batch.key_cache, batch.value_cache):
        x = to_numpy(pool)
        x = np.where(np.isnan(x), 0.0, x)
        stored = ref.quantize_rows(x, name, batch.query.dtype)
        values = ref.dequantize_rows(stored, name)
        if name == "int4_per_token_head":
            values = ref.rotate(values, inverse=True) / (x.shape[-1] & -x.shape[-1])
        out.append((mx.array(stored), values))
    return out[0][0], out[1][0], out[0][1], out[1][1]


CASES = {
    "decode": {"q_lens": [1, 1, 1], "ctx_lens": [5, 33, 64]},
    "verify": {"q_lens": [4, 4, 4], "ctx_lens": [5, 33, 64]},  # three drafts each
    "mixed": {"q_lens": [1, 7, batched.TILE + 3, 0], "ctx_lens": [9, 20, 90, 4]},
}
OPTIONS = {"causal": {}, "window": {"sliding_window": 5}, "softcap": {"softcap": 5.0}}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "name,dtype",
    [(n, "float32") for n in FORMATS] + [(FORMATS[0], "bfloat16"), (FORMATS[2], "bfloat16")],
)
def test_attention_reads_vllms_values(name: str, dtype: str, case: str, option: str) -> None:
    rng = np.random.default_rng(len(case) + 3 * len(option))
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, **CASES[case]
    )
    kc, vc, keys, values = _stored_pools(batch, name)
    kwargs = dict(OPTIONS[option])
    sinks = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
    args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    # Rows of one length per sequence: declared, and traced by mx.compile (nothing read on the
    # host, int4's rotations in the trace).
    rows = CASES[case]["q_lens"][0] if case != "mixed" else None
    attention = functools.partial(
        ops.paged_attention, scale=0.125, kv_cache_dtype=name, max_query_len=rows, **kwargs
    )
    if rows is not None:
        attention = mx.compile(attention)
    got = attention(*args, sinks=sinks)
    assert got.dtype == batch.query.dtype
    want = naive_attention(
        to_numpy(batch.query),
        keys,
        values,
        *(np.asarray(a) for a in args[3:]),
        scale=0.125,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=np.asarray(sinks),
    )
    assert_close(got, mx.array(want.astype(np.float32)), dtype)


@pytest.mark.parametrize("name", ["int4_per_token_head", "int8_per_token_head"])
def test_key_ends_rows_read_per_token_head(name: str) -> None:
    """Prefix-LM rows (MLX's reference) beside the op's rows (the native op where the extension
    runs; int4's rotations around both)."""
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng, q_lens=[6], ctx_lens=[10], num_heads=4, num_kv_heads=2, head_size=64, block_size=16
    )
    kc, vc, keys, values = _stored_pools(batch, name)
    key_ends = np.array([0, 0, 9, 9, 9, 0])
    args = (batch.query, kc, vc, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    got = ops.paged_attention(*args, scale=0.125, key_ends=key_ends, kv_cache_dtype=name)
    want = naive_attention(
        to_numpy(batch.query), keys, values, *(np.asarray(a) for a in args[3:]),
        scale=0.125, sliding_window=None, softcap=None, sinks=None, key_ends=key_ends,
    )  # fmt: skip
    assert_close(got, mx.array(want.astype(np.float32)), "float32")
    # The per-sequence reference reads the rows as the batched op does.
    quant = ptk.kv_quant("int8_per_token_head")
    kc, vc, *_ = _stored_pools(batch, "int8_per_token_head")
    args = (batch.query, kc, vc, *args[3:])
    a = reference.paged_attention(*args, scale=0.125, quant=quant)
    b = batched.paged_attention(*args, scale=0.125, quant=quant)
    assert_close(a, b, "float32")


@pytest.mark.parametrize(
    "name,width,dim,match",
    [
        ("int8_per_token_head", 64, 64, "68 bytes"),
        ("int4_per_token_head", 68, 64, "36 bytes"),
        ("int4_per_token_head", 36, 63, "even head_size"),
        ("int2_per_token_head", 68, 64, "kv_cache_dtype must be one of"),
    ],
)
def test_malformed_pools_are_refused(name: str, width: int, dim: int, match: str) -> None:
    pool = mx.zeros((2, 16, 2, width), mx.uint8)
    rows = mx.zeros((3, 2, dim))
    slots = mx.array(np.array([0, 1, 2], np.int64))
    with pytest.raises(ValueError, match=match):
        ops.reshape_and_cache(rows, rows, pool, pool, slots, kv_cache_dtype=name)
    with pytest.raises(ValueError, match="must be uint8"):
        ops.reshape_and_cache(rows, rows, pool.astype(mx.float32), pool.astype(mx.float32),
                              slots, kv_cache_dtype="int8_per_token_head")  # fmt: skip


# Planted bugs: each is a plausible slip in the format; the oracle comparisons above must catch it.
def _nibbles_swapped(x, name):
    rows = np.asarray(ptk.quantize(x, name)).copy()
    data = rows[..., :-4]
    rows[..., :-4] = (data >> 4) | ((data & 0xF) << 4)
    return mx.array(rows)


MUTANTS = {
    "int8 rounds half to even": ("int8_per_token_head", "_round_half_away", lambda x: mx.round(x)),
    "int8 truncates": ("int8_per_token_head", "_round_half_away", lambda x: x),
    "int8 scale over 128": ("int8_per_token_head", "INT8_MAX", 128.0),
    "fp8 scale over 240": ("fp8_per_token_head", "FP8", replace(ptk.FP8, max_finite=240.0)),
    "int4 scale over 16 levels": ("int4_per_token_head", "INT4_LEVELS", 16.0),
    "int4 rotation seed": ("int4_per_token_head", "RHT_SEED", 1),
    "min scale": ("int8_per_token_head", "MIN_SCALE", 1e-5),
}  # fmt: skip


@pytest.mark.parametrize("mutant", [*MUTANTS, "int4 nibbles swapped"])
def test_planted_bugs_are_caught(monkeypatch, mutant: str) -> None:
    rng = np.random.default_rng(5)
    x = mx.array(_rows(rng, (32, 2, 64)))
    if mutant == "int4 nibbles swapped":
        name = "int4_per_token_head"
        got = np.asarray(_nibbles_swapped(x, name))
    else:
        name, attr, value = MUTANTS[mutant]
        monkeypatch.setattr(ptk, attr, value)
        ptk._SIGNS.clear()
        got = np.asarray(ptk.quantize(x, name))
    ptk._SIGNS.clear()
    want = ref.quantize_rows(to_numpy(x), name)
    assert (got != want).any(), f"planted bug {mutant!r} not caught"
