"""Proves the per-token-head formats (int8 / fp8 / int4_per_token_head) in every Metal kernel family
that touches the KV pools, run through the MSL harness as the host plans them: the cache write
stores vLLM's rows byte for byte (the float64 port tests/fixtures/per_token_head_reference.py; int4
rows arrive rotated, as the ops hand them over), and decode, GQA decode, split-KV (with its
reduce), tiled prefill and NAX prefill read the rows as attention over the port's dequantized pools
(rounded to the query's dtype; int4: in the rotated space, the rotations staying outside)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.fixtures import per_token_head_reference as ref

from . import kernels as K
from . import oracle as O
from .test_kernels import ATOL

pytestmark = pytest.mark.msl

FORMATS = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
INT4 = FORMATS[2]
SCALE_BYTES = 4


def row_bytes(name: str, dim: int) -> int:
    return (dim // 2 if name == INT4 else dim) + SCALE_BYTES


def stored_rows(rows: np.ndarray, name: str) -> np.ndarray:
    """The port's bytes of rows as the write kernel receives them (int4: already rotated)."""
    if name == INT4:
        return ref.pack_row(*ref.store_int4(rows.astype(np.float64)), name)
    return ref.quantize_rows(rows.astype(np.float32), name)


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_METAL_DISABLE_GQA_DECODE", raising=False)
    monkeypatch.delenv("VLLM_METAL_DISABLE_NAX", raising=False)


def spread_rows(x: np.ndarray, seed: int) -> np.ndarray:
    """Rows whose magnitudes differ by up to 64x from row to row (so a row read with another
    row's scale is visibly wrong), a few zero rows, and int8 ties."""
    rng = np.random.default_rng(seed)
    y = x * np.exp2(rng.uniform(-3, 3, x.shape[:-1] + (1,)))
    flat = y.reshape(-1, y.shape[-1])
    flat[0] = 0.0
    flat[1] = (np.arange(y.shape[-1]) % 21 - 10) + 0.5
    flat[1, 0] = 127.0
    return y


def test_reshape_and_cache_pth_stores_vllms_rows() -> None:
    heads, dim, block_size, num_blocks, T = 2, 64, 16, 6, 40
    for i, (name, dtype) in enumerate(
        [(FORMATS[0], "f32"), (FORMATS[1], "f16"), (FORMATS[0], "bf16"), (FORMATS[1], "bf16"),
         (INT4, "f32"), (INT4, "f16"), (INT4, "bf16")]
    ):  # fmt: skip
        width = row_bytes(name, dim)
        rng = np.random.default_rng(T + i)
        key = O.quantize(spread_rows(rng.standard_normal((T, heads, dim)) * 3, i), dtype)
        value = O.quantize(spread_rows(rng.standard_normal((T, heads, dim)), i + 7), dtype)
        start = rng.integers(0, 256, (num_blocks, block_size, heads, width), dtype=np.uint8)
        n = num_blocks * block_size
        slots = (1 + rng.choice(n - 2, T, replace=False)).astype(np.int64)
        slots[:4] = [0, n - 1, -1, n]  # first and last slot, padding, out of range
        got_k, got_v = K.reshape_and_cache(
            key, value, start, start, slots, dtype, kv_cache_dtype=name
        )
        kept = (slots >= 0) & (slots < n)
        for got, rows in ((got_k, key), (got_v, value)):
            want = start.reshape(-1, heads, width).copy()
            want[slots[kept]] = stored_rows(rows[kept], name)
            np.testing.assert_array_equal(got.reshape(-1, heads, width), want, err_msg=name)


def pth_case(name: str, **kwargs: object) -> tuple[K.AttentionCase, K.AttentionCase]:
    """(the case with its pools stored as per-token-head rows, the same case over the port's
    dequantized pools rounded to the query's dtype: what the kernels must compute with)."""
    case = K.make_case(**kwargs)
    seed = int(kwargs.get("seed", 0))
    kc = ref.quantize_rows(spread_rows(case.key_cache, seed).astype(np.float32), name)
    vc = ref.quantize_rows(spread_rows(case.value_cache, seed + 1).astype(np.float32), name)
    stored = dataclasses.replace(case, key_cache=kc, value_cache=vc, kv_cache_dtype=name)
    read = dataclasses.replace(
        case,
        key_cache=O.quantize(ref.dequantize_rows(kc, name), case.dtype),
        value_cache=O.quantize(ref.dequantize_rows(vc, name), case.dtype),
    )
    return stored, read


def check(stored: K.AttentionCase, read: K.AttentionCase, launches: list[dict]) -> None:
    assert all("_fp8_" in launch["kernel"] for launch in launches), "byte-pool instances planned"
    out = K.paged_attention(stored, launches)
    want = K.reference(read)
    assert np.isfinite(out).all(), "rows left unwritten (NaN) or non-finite output"
    err = np.abs(out - want).max() / max(1.0, float(np.abs(want).max()))
    assert err <= ATOL[stored.dtype], f"{[l['kernel'] for l in launches]}: max error {err:.3g}"


@pytest.mark.parametrize(
    "dtype,name,hq,hkv,d,bs",
    [
        ("f32", FORMATS[0], 8, 2, 64, 16),
        ("f16", FORMATS[1], 4, 1, 128, 32),
        ("bf16", FORMATS[0], 6, 2, 80, 8),
        ("f32", FORMATS[1], 4, 2, 64, 16),
        ("f16", INT4, 8, 2, 64, 16),
        ("bf16", INT4, 4, 1, 96, 32),
    ],
)
@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode_pth(
    family: str, dtype: str, name: str, hq: int, hkv: int, d: int, bs: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    stored, read = pth_case(
        name, dtype=dtype, q_lens=[1, 1, 1], seq_lens=[1, 45, 97], num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, block_size=bs, sliding_window=60, sinks=True, seed=d + hq,
    )  # fmt: skip
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == [family]
    check(stored, read, launches)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode_split_kv_pth(family: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    stored, read = pth_case(
        name, dtype="f16", q_lens=[1, 1, 1], seq_lens=[200, 31, 150], num_q_heads=8,
        num_kv_heads=2, head_dim=64, block_size=16, softcap=20.0, sinks=True, seed=5,
    )  # fmt: skip
    (launch,) = K.host_plan(stored)
    launch = K.split_partitions(launch, stored, 64)
    assert launch["total_partitions"] > 3, "the case must split some rows"
    check(stored, read, [launch])


@pytest.mark.parametrize(
    "dtype,name,hq,hkv,d,bs",
    [
        ("f32", FORMATS[1], 4, 2, 64, 16),
        ("f16", FORMATS[0], 4, 1, 128, 8),
        ("bf16", FORMATS[0], 2, 1, 512, 16),  # two value-column halves
        ("f32", INT4, 4, 2, 64, 16),
        ("bf16", INT4, 2, 1, 512, 16),
    ],
)
def test_prefill_pth(dtype: str, name: str, hq: int, hkv: int, d: int, bs: int) -> None:
    stored, read = pth_case(
        name, dtype=dtype, q_lens=[1, 9, 21], seq_lens=[30, 9, 47], num_q_heads=hq,
        num_kv_heads=hkv, head_dim=d, block_size=bs, sliding_window=25, softcap=15.0, seed=d,
    )  # fmt: skip
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == ["prefill"]
    check(stored, read, launches)


@pytest.mark.parametrize(
    "dtype,name,d", [("f16", FORMATS[1], 64), ("bf16", FORMATS[0], 128), ("f16", INT4, 128)]
)
def test_nax_prefill_pth(dtype: str, name: str, d: int) -> None:
    stored, read = pth_case(
        name, dtype=dtype, q_lens=[1, 11, 19], seq_lens=[25, 11, 40], num_q_heads=4,
        num_kv_heads=2, head_dim=d, block_size=16, sliding_window=20, sinks=True, seed=d + 1,
    )  # fmt: skip
    launches = K.host_plan(stored, supports_nax=True)
    assert [launch["family"] for launch in launches] == ["nax"]
    check(stored, read, launches)


@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_int4_one_key_reads_its_row_exactly(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence of one key returns its value row (softmax weight 1), so in float32 the output is
    the row's `(level - zp) * scale'` to the bit: a scale read with its zero point left in the low
    mantissa bits is off by a few ulps, too little for the tolerance of the cases above."""
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    stored, _ = pth_case(
        INT4, dtype="f32", q_lens=[1, 1], seq_lens=[1, 1], num_q_heads=8, num_kv_heads=2,
        head_dim=64, block_size=16, seed=3,
    )  # fmt: skip
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == [family]
    out = K.paged_attention(stored, launches)
    values = ref.dequantize_rows(stored.value_cache, INT4).astype(np.float32)
    rows = values[stored.block_tables[:, 0], 0]  # [S, Hkv, D]: each sequence's only key
    np.testing.assert_array_equal(out, np.repeat(rows, 4, axis=1))
