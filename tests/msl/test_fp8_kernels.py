"""Proves the fp8 instances of every Metal kernel family that touches the KV pools, run through the
MSL harness as the host plans them: the cache write stores vLLM's fp8 bytes (a float64
brute-force quantizer's), and decode, GQA decode, split-KV (with its reduce), tiled prefill and NAX
prefill read fp8 pools as attention over float64-dequantized pools (rounded to the query's dtype)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from tests.fixtures.fp8_reference import dequantize64, exact_values, quantize64

from . import kernels as K
from . import oracle as O
from .test_kernels import ATOL

pytestmark = pytest.mark.msl

FORMATS = ("fp8_e4m3", "fp8_e5m2")


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_METAL_DISABLE_GQA_DECODE", raising=False)
    monkeypatch.delenv("VLLM_METAL_DISABLE_NAX", raising=False)


# ---------------------------------------------------------------------------------------------
# reshape_and_cache into fp8 pools
# ---------------------------------------------------------------------------------------------


def edge_rows(name: str, dtype: str, shape: tuple[int, ...], scale: float, seed: int) -> np.ndarray:
    """Rows (representable in `dtype`) that, divided by `scale`, visit every rounding case of the
    format: ordinary values, subnormals, every finite value and the midpoints between neighbours
    (ties), values past the largest finite one, infinities, zeros of both signs and NaN."""
    rng = np.random.default_rng(seed)
    table = exact_values(name)
    finite = np.sort(table[np.isfinite(table)])
    top = finite[-1]
    smallest = finite[finite > 0][0]
    pool = np.concatenate(
        [
            rng.standard_normal(2048) * top / 16,
            rng.standard_normal(512) * smallest * 4,
            finite,
            (finite[1:] + finite[:-1]) / 2,
            [top * 1.02, -top * 3, np.inf, -np.inf, 0.0, -0.0, np.nan],
        ]
    )
    picked = np.resize(rng.permutation(pool), int(np.prod(shape))).reshape(shape)
    return O.quantize(picked * scale, dtype)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", O.DTYPES)
def test_reshape_and_cache_fp8(dtype: str, name: str) -> None:
    heads, dim, block_size, num_blocks, T = 2, 64, 16, 6, 40
    k_scale, v_scale = (0.5, 3.0) if name == "fp8_e4m3" else (2.0, 0.25)
    key = edge_rows(name, dtype, (T, heads, dim), k_scale, seed=len(dtype))
    value = edge_rows(name, dtype, (T, heads, dim), v_scale, seed=len(dtype) + 1)
    rng = np.random.default_rng(T)
    start = rng.integers(0, 256, (num_blocks, block_size, heads, dim), dtype=np.uint8)
    n = num_blocks * block_size
    slots = (1 + rng.choice(n - 2, T, replace=False)).astype(np.int64)  # distinct slots
    slots[:4] = [0, n - 1, -1, n]  # first and last slot, padding, out of range
    got_k, got_v = K.reshape_and_cache(
        key,
        value,
        start,
        start,
        slots,
        dtype,
        kv_cache_dtype=name,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    for got, rows, scale in ((got_k, key, k_scale), (got_v, value, v_scale)):
        want = start.reshape(-1, heads, dim).copy()
        kept = (slots >= 0) & (slots < n)
        want[slots[kept]] = quantize64(rows[kept].astype(np.float64), name, scale)
        got = got.reshape(-1, heads, dim)
        table = exact_values(name)
        np.testing.assert_array_equal(table[got], table[want])  # +0 and -0 alike
        nan = np.isnan(rows[kept])
        assert (got[slots[kept]][nan] == K.constant("FP8_NAN_CODE")).all()


# ---------------------------------------------------------------------------------------------
# Attention over fp8 pools
# ---------------------------------------------------------------------------------------------


def fp8_case(
    name: str, k_scale: float = 0.25, v_scale: float = 2.0, **kwargs: object
) -> tuple[K.AttentionCase, K.AttentionCase]:
    """(the case with its pools stored as fp8 bytes, the same case over the float64-dequantized
    pools rounded to the query's dtype: what the kernels must compute with)."""
    case = K.make_case(**kwargs)
    # Pool values spread over the format's range at these scales (x / scale up to ~ +-16).
    kc = quantize64(case.key_cache * (4 * k_scale), name, k_scale)
    vc = quantize64(case.value_cache * (4 * v_scale), name, v_scale)
    stored = dataclasses.replace(
        case, key_cache=kc, value_cache=vc, kv_cache_dtype=name, k_scale=k_scale, v_scale=v_scale
    )
    read = dataclasses.replace(
        case,
        key_cache=O.quantize(dequantize64(kc, name, k_scale), case.dtype),
        value_cache=O.quantize(dequantize64(vc, name, v_scale), case.dtype),
    )
    return stored, read


def check(stored: K.AttentionCase, read: K.AttentionCase, launches: list[dict]) -> None:
    assert all("_fp8_" in launch["kernel"] for launch in launches), "fp8 instances planned"
    out = K.paged_attention(stored, launches)
    ref = K.reference(read)
    assert np.isfinite(out).all(), "rows left unwritten (NaN) or non-finite output"
    # The values are up to 8 v_scale: the error bound scales with them.
    err = np.abs(out - ref).max() / max(1.0, float(np.abs(ref).max()))
    assert err <= ATOL[stored.dtype], f"{[l['kernel'] for l in launches]}: max error {err:.3g}"


DECODE_CASES = [
    # dtype, format, Hq, Hkv, D, block_size
    ("f32", "fp8_e4m3", 8, 2, 64, 16),
    ("f16", "fp8_e5m2", 4, 1, 128, 32),
    ("bf16", "fp8_e4m3", 6, 2, 80, 8),
]


@pytest.mark.parametrize("dtype,name,hq,hkv,d,bs", DECODE_CASES)
@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode_fp8(
    family: str,
    dtype: str,
    name: str,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    stored, read = fp8_case(
        name,
        dtype=dtype,
        q_lens=[1, 1, 1],
        seq_lens=[1, 45, 97],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        sliding_window=60,
        sinks=True,
        seed=d + hq,
    )
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == [family]
    check(stored, read, launches)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode_split_kv_fp8(family: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Partitions of 64 keys through the reduce kernel (the host's own split needs > 512 keys).
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    stored, read = fp8_case(
        name,
        dtype="f16",
        q_lens=[1, 1, 1],
        seq_lens=[200, 31, 150],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        softcap=20.0,
        sinks=True,
        seed=5,
    )
    (launch,) = K.host_plan(stored)
    launch = K.split_partitions(launch, stored, 64)
    assert launch["total_partitions"] > 3, "the case must split some rows"
    check(stored, read, [launch])


@pytest.mark.parametrize(
    "dtype,name,hq,hkv,d,bs",
    [
        ("f32", "fp8_e5m2", 4, 2, 64, 16),
        ("f16", "fp8_e4m3", 4, 1, 128, 8),
        ("bf16", "fp8_e4m3", 2, 1, 512, 16),  # two value-column halves
    ],
)
def test_prefill_fp8(dtype: str, name: str, hq: int, hkv: int, d: int, bs: int) -> None:
    stored, read = fp8_case(
        name,
        dtype=dtype,
        q_lens=[1, 9, 21],
        seq_lens=[30, 9, 47],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        sliding_window=25,
        softcap=15.0,
        seed=d,
    )
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == ["prefill"]
    check(stored, read, launches)


def _fp8_prefill_instances() -> list[str]:
    return sorted(
        n
        for n in K.native().all_kernel_names()
        if n.startswith("paged_attention_prefill_")
        and "_fp8_" in n
        and "_d512" not in n
        and "_d256" not in n
    )


@pytest.mark.parametrize("kernel", _fp8_prefill_instances())
def test_prefill_every_fp8_tile(kernel: str) -> None:
    # Every fp8 instance (head dims <= 128), planned for a block size it serves; formats alternate.
    m = re.match(r"paged_attention_prefill_(\w+)_fp8_d(\d+)_b(\d+)$", kernel)
    dtype, d, divisor = m[1], int(m[2]), int(m[3])
    stored, read = fp8_case(
        FORMATS[(d // 16 + divisor // 8) % 2],
        dtype=dtype,
        q_lens=[12, 1, 30],
        seq_lens=[40, 19, 30],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=d,
        block_size=divisor,
        sliding_window=25,
        sinks=True,
        seed=divisor + d,
    )
    (launch,) = K.host_plan(stored)
    assert launch["kernel"] == kernel
    check(stored, read, [launch])


@pytest.mark.parametrize("dtype,name,d", [("f16", "fp8_e4m3", 64), ("bf16", "fp8_e5m2", 128)])
def test_nax_prefill_fp8(dtype: str, name: str, d: int) -> None:
    stored, read = fp8_case(
        name,
        dtype=dtype,
        q_lens=[1, 11, 19],
        seq_lens=[25, 11, 40],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=d,
        block_size=16,
        sliding_window=20,
        sinks=True,
        seed=d + 1,
    )
    launches = K.host_plan(stored, supports_nax=True)
    assert [launch["family"] for launch in launches] == ["nax"]
    check(stored, read, launches)


def test_mixed_batch_fp8_as_host_plans_it() -> None:
    # Prefill rows and a long decode row (its own split-KV launch) over one pair of fp8 pools.
    stored, read = fp8_case(
        "fp8_e4m3",
        dtype="f16",
        q_lens=[5, 1],
        seq_lens=[20, 4200],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=32,
        seed=2,
    )
    launches = K.host_plan(stored)
    assert [launch["family"] for launch in launches] == ["prefill", "gqa"]
    assert launches[1]["partition_size"] > 0
    check(stored, read, launches)
