"""Proves each metal_kernels/<op>/*.metal family, run through the MSL harness as the host plans
it, matches vllm_metal.ops.reference across dtypes, head dims, GQA, masks, sinks, partitions,
tiles; and that the sources instantiate exactly the kernels the host can request."""

from __future__ import annotations

import re

import numpy as np
import pytest

from . import kernels as K
from . import oracle as O

pytestmark = pytest.mark.msl

# Max |kernel - reference| on outputs of magnitude <~ 1 (inputs N(0, 1)); bf16/f16 kernels round
# the probabilities they feed to the P V product to the storage type.
ATOL = {"f32": 2e-5, "f16": 4e-3, "bf16": 3e-2}


def check(case: K.AttentionCase, launches: list[dict]) -> None:
    out = K.paged_attention(case, launches)
    ref = K.reference(case)
    assert np.isfinite(out).all(), "rows left unwritten (NaN) or non-finite output"
    err = np.abs(out - ref).max()
    assert err <= ATOL[case.dtype], f"{[l['kernel'] for l in launches]}: max error {err:.3g}"


@pytest.fixture(autouse=True)
def _no_env_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_METAL_DISABLE_GQA_DECODE", raising=False)
    monkeypatch.delenv("VLLM_METAL_DISABLE_NAX", raising=False)


def families(launches: list[dict]) -> list[str]:
    return [launch["family"] for launch in launches]


# ---------------------------------------------------------------------------------------------
# Coverage of the host's kernel names
# ---------------------------------------------------------------------------------------------


def test_sources_instantiate_exactly_the_kernels_the_host_can_request() -> None:
    # Both sides expand the instance lists of csrc/constants.h; this proves they agree.
    instantiated: set[str] = set()
    for src in sorted(K.KERNEL_DIR.rglob("*.metal")):
        instantiated |= set(K.program(str(src.relative_to(K.KERNEL_DIR))).instances)
    requested = set(K.native().all_kernel_names())
    assert sorted(requested - instantiated) == [], "host can request kernels no source has"
    assert sorted(instantiated - requested) == [], "sources instantiate kernels the host never uses"


def test_numpy_oracle_agrees_with_reference() -> None:
    # Guards the oracle the tests depend on: two independent implementations of the contract.
    case = K.make_case(
        dtype="f32",
        q_lens=[1, 5],
        seq_lens=[23, 40],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        sliding_window=17,
        softcap=8.0,
        sinks=True,
    )
    ours = O.paged_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        case.cu_seqlens_q,
        scale=case.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=case.sinks,
    )
    np.testing.assert_allclose(ours, K.reference(case), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# reshape_and_cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", O.DTYPES)
@pytest.mark.parametrize("heads,head_dim,block_size", [(2, 64, 16), (3, 80, 8), (1, 256, 32)])
def test_reshape_and_cache(dtype: str, heads: int, head_dim: int, block_size: int) -> None:
    import mlx.core as mx

    from vllm_metal.ops import reference as ref

    rng = np.random.default_rng(heads * head_dim)
    num_blocks = 6
    T = 9
    key = O.quantize(rng.standard_normal((T, heads, head_dim)), dtype)
    value = O.quantize(rng.standard_normal((T, heads, head_dim)), dtype)
    kc = O.quantize(rng.standard_normal((num_blocks, block_size, heads, head_dim)), dtype)
    vc = O.quantize(rng.standard_normal((num_blocks, block_size, heads, head_dim)), dtype)
    n = num_blocks * block_size
    # Slot 0, the last slot, padding (-1) and an out-of-range slot.
    slots = np.array([0, 5, -1, n - 1, block_size, 2 * block_size + 3, n, 7, -5], np.int64)
    got_k, got_v = K.reshape_and_cache(key, value, kc, vc, slots, dtype)
    want_k, want_v = ref.reshape_and_cache(
        mx.array(key), mx.array(value), mx.array(kc), mx.array(vc), mx.array(slots)
    )
    np.testing.assert_array_equal(got_k, np.array(want_k))
    np.testing.assert_array_equal(got_v, np.array(want_v))


# ---------------------------------------------------------------------------------------------
# Decode: per-head kernel and GQA kernel, one pass and split-KV
# ---------------------------------------------------------------------------------------------

DECODE_SHAPES = [
    # dtype, Hq, Hkv, D, block_size
    ("f32", 4, 4, 64, 16),
    ("f16", 4, 2, 80, 8),
    ("bf16", 8, 2, 96, 32),
    ("f16", 2, 1, 128, 16),
    ("bf16", 2, 2, 256, 16),
    ("f32", 12, 1, 64, 32),  # G = 12: two GQA row tiles, the second padded
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs", DECODE_SHAPES)
@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode(
    family: str, dtype: str, hq: int, hkv: int, d: int, bs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if family == "gqa" and hq == hkv:
        pytest.skip("the host never runs the GQA kernel without grouping")
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    case = K.make_case(
        dtype=dtype,
        q_lens=[1, 1, 1],
        seq_lens=[1, 45, 97],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        seed=d + hq,
    )
    launches = K.host_plan(case)
    assert families(launches) == [family]
    check(case, launches)


@pytest.mark.parametrize("family", ["decode", "gqa"])
@pytest.mark.parametrize("kb", [8, 16, 32])
def test_decode_kernel_blocks(family: str, kb: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every kernel-block instance, including those the host picks only for other block sizes.
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    case = K.make_case(
        dtype="f16",
        q_lens=[1, 1],
        seq_lens=[70, 33],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=32,
        sliding_window=40,
        seed=kb,
    )
    (launch,) = K.host_plan(case)
    launch = K.with_kernel(launch, re.sub(r"_b\d+$", f"_b{kb}", launch["kernel"]), kb)
    check(case, [launch])


@pytest.mark.parametrize("family", ["decode", "gqa"])
@pytest.mark.parametrize(
    "dtype,window,softcap,sinks",
    [
        ("f32", None, None, True),
        ("bf16", 50, None, False),
        ("f16", 64, 30.0, True),
        ("f32", 1, None, False),
        ("f16", None, 5.0, False),
    ],
)
def test_decode_masks_softcap_sinks(
    family: str,
    dtype: str,
    window: int | None,
    softcap: float | None,
    sinks: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    case = K.make_case(
        dtype=dtype,
        q_lens=[1, 1, 1],
        seq_lens=[3, 66, 130],
        num_q_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
        seed=7,
    )
    check(case, K.host_plan(case))


@pytest.mark.parametrize("family", ["decode", "gqa"])
@pytest.mark.parametrize(
    "dtype,partition,window,sinks,seq_lens",
    [
        ("f32", 32, None, False, [1, 40, 150]),
        ("f16", 64, 70, True, [90, 200, 31]),
        ("bf16", 32, 33, True, [64, 129, 250]),
        ("f32", 96, None, True, [300, 5, 97]),
    ],
)
def test_decode_split_kv(
    family: str,
    dtype: str,
    partition: int,
    window: int | None,
    sinks: bool,
    seq_lens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    case = K.make_case(
        dtype=dtype,
        q_lens=[1] * len(seq_lens),
        seq_lens=seq_lens,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        sliding_window=window,
        sinks=sinks,
        softcap=20.0,
        seed=partition,
    )
    (launch,) = K.host_plan(case)
    launch = K.split_partitions(launch, case, partition)
    assert launch["total_partitions"] > len(seq_lens), "the case must split some rows"
    check(case, [launch])


@pytest.mark.parametrize("family", ["decode", "gqa"])
def test_decode_split_as_host_plans_it(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Long rows: the host itself chooses split-KV (512-key partitions) and the reduce kernel.
    if family == "decode":
        monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    case = K.make_case(
        dtype="f16",
        q_lens=[1, 1],
        seq_lens=[1100, 530],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=32,
        sinks=True,
        seed=3,
    )
    (launch,) = K.host_plan(case)
    assert launch["family"] == family and launch["partition_size"] > 0
    check(case, [launch])


# ---------------------------------------------------------------------------------------------
# Prefill: tiled simdgroup-matrix kernel and NAX (tensor ops) kernel
# ---------------------------------------------------------------------------------------------

PREFILL_SHAPES = [
    # dtype, Hq, Hkv, D, block_size
    ("f32", 2, 2, 64, 16),
    ("f16", 4, 2, 80, 32),
    ("bf16", 6, 2, 96, 16),
    ("f16", 4, 1, 128, 8),
    ("bf16", 2, 1, 256, 16),
    ("f32", 2, 1, 256, 8),
    ("f16", 2, 1, 512, 16),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs", PREFILL_SHAPES)
def test_prefill(dtype: str, hq: int, hkv: int, d: int, bs: int) -> None:
    case = K.make_case(
        dtype=dtype,
        q_lens=[1, 9, 21],
        seq_lens=[30, 9, 47],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=bs,
        seed=d,
    )
    launches = K.host_plan(case)
    assert families(launches) == ["prefill"]
    check(case, launches)


def _prefill_instances() -> list[str]:
    names = K.native().all_kernel_names()
    return sorted(
        n
        for n in names
        if n.startswith("paged_attention_prefill_")
        and "_d512" not in n
        and "_d256" not in n
        and "_fp8_" not in n  # test_fp8_kernels.py
    )


@pytest.mark.parametrize("kernel", _prefill_instances())
def test_prefill_every_tile(kernel: str) -> None:
    # Every instance (head dims <= 128), planned for a block size it serves; windows, softcap, sinks.
    m = re.match(r"paged_attention_prefill_(\w+)_d(\d+)_b(\d+)$", kernel)
    dtype, d, divisor = m[1], int(m[2]), int(m[3])
    case = K.make_case(
        dtype=dtype,
        q_lens=[12, 1, 30],
        seq_lens=[40, 19, 30],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=d,
        block_size=divisor,
        sliding_window=25,
        softcap=15.0,
        sinks=True,
        seed=divisor + d,
    )
    (launch,) = K.host_plan(case)
    assert launch["kernel"] == kernel
    check(case, [launch])


@pytest.mark.parametrize(
    "dtype,window,softcap,sinks",
    [("f16", 1, None, False), ("bf16", 16, 10.0, True), ("f32", 33, None, True)],
)
def test_prefill_masks(dtype: str, window: int | None, softcap: float | None, sinks: bool) -> None:
    case = K.make_case(
        dtype=dtype,
        q_lens=[40, 3],
        seq_lens=[60, 3],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
        seed=11,
    )
    check(case, K.host_plan(case))


def test_mixed_batch_prefill_and_decode_launches() -> None:
    # Prefill rows through the tiled kernel and decode rows through the GQA kernel, one output.
    case = K.make_case(
        dtype="f16",
        q_lens=[1, 13, 1, 6],
        seq_lens=[80, 13, 35, 50],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        sinks=True,
    )
    (full,) = K.host_plan(case)
    prefill_seqs, decode_seqs = [1, 3], [0, 2]
    work = []
    for s in prefill_seqs:
        q_len = int(case.cu_seqlens_q[s + 1] - case.cu_seqlens_q[s])
        for t in range(-(-q_len * 2 // full["rows_per_tile"])):
            work += [s, t]
    prefill = dict(full, work=work, grid=[len(work) // 2, full["grid"][1], 1])
    only_decode = K.make_case(
        dtype="f16",
        q_lens=[1, 1],
        seq_lens=[80, 35],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
    )
    (decode,) = K.host_plan(only_decode)
    decode = K.split_partitions(dict(decode, work=decode_seqs), case, 32)
    check(case, [prefill, decode])


def test_fused_qkv_query_strides() -> None:
    # The query is a view into a fused [T, Hq + 2 Hkv, D] projection: token stride != Hq * D.
    for q_lens, seq_lens in (([1, 1], [20, 70]), ([5, 17], [5, 40])):
        case = K.make_case(
            dtype="bf16",
            q_lens=q_lens,
            seq_lens=seq_lens,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            fused_qkv=True,
        )
        check(case, K.host_plan(case))


@pytest.mark.parametrize(
    "dtype,hq,hkv,d,window,softcap,sinks",
    [
        ("f16", 4, 2, 64, None, None, False),
        ("bf16", 6, 2, 80, 20, 12.0, True),
        ("f16", 2, 1, 128, 7, None, True),
        ("bf16", 2, 1, 512, None, None, True),
    ],
)
def test_nax_prefill(
    dtype: str, hq: int, hkv: int, d: int, window: int | None, softcap: float | None, sinks: bool
) -> None:
    case = K.make_case(
        dtype=dtype,
        q_lens=[1, 11, 19],
        seq_lens=[25, 11, 40],
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        block_size=16,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
        seed=d + 1,
    )
    launches = K.host_plan(case, supports_nax=True)
    assert families(launches) == ["nax"]
    check(case, launches)


# ---------------------------------------------------------------------------------------------
# gated_delta_rule, causal_conv1d and mamba2_scan (one kernel each; the host's launch; the
# references of vllm_metal/ops/gated_delta, vllm_metal/ops/short_conv and vllm_metal/ops/mamba2)
# ---------------------------------------------------------------------------------------------

# |kernel - reference| <= atol + rtol |reference|: the kernels and the references read the same
# dtype-rounded inputs and sum in float32; y is rounded to the dtype once (f16: 2^-11 relative,
# bf16: 2^-8). States are float32.
LINEAR_TOL = {"f32": (1e-5, 1e-5), "f16": (2e-3, 1e-3), "bf16": (1.5e-2, 8e-3)}


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    atol, rtol = LINEAR_TOL[dtype]
    assert np.isfinite(got).all(), f"{what}: rows left unwritten (NaN) or non-finite"
    err = np.abs(got - want) - rtol * np.abs(want)
    assert err.max() <= atol, f"{what}: max error {np.abs(got - want).max():.3g}"


def _cu(lens: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.mark.parametrize(
    "dtype,lens,hk,hv,dk,dv",
    [
        ("f16", [7, 1, 0, 3], 2, 4, 64, 64),  # GQA Hv = 2 Hk, an empty sequence
        ("f32", [3, 0, 5], 1, 3, 37, 5),  # odd sizes: partial lanes, partial row block
        ("bf16", [1, 1, 1], 1, 1, 256, 6),  # decode rows, the widest key dim
    ],
)
def test_gated_delta_rule(dtype: str, lens: list[int], hk: int, hv: int, dk: int, dv: int) -> None:
    import mlx.core as mx

    from vllm_metal.ops.gated_delta import reference as ref

    rng = np.random.default_rng(dk + dv)
    T, S = sum(lens), len(lens)
    k = rng.standard_normal((T, hk, dk))
    k = O.quantize(k / np.linalg.norm(k, axis=-1, keepdims=True), dtype)
    q = O.quantize(rng.standard_normal((T, hk, dk)) / np.sqrt(dk), dtype)
    v = O.quantize(rng.standard_normal((T, hv, dv)), dtype)
    g = rng.uniform(0.3, 1.0, (T, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, hv)).astype(np.float32)
    state = (rng.standard_normal((S, hv, dv, dk)) * 0.5).astype(np.float32)
    cu = _cu(lens)
    y, new_state = K.gated_delta_rule(q, k, v, g, beta, state, cu, dtype)
    want_y, want_state = ref.gated_delta_rule(*(mx.array(a) for a in (q, k, v, g, beta, state, cu)))
    assert_close(y, np.array(want_y), dtype, "y")
    assert_close(new_state, np.array(want_state), "f32", "state")
    for s in np.flatnonzero(np.asarray(lens) == 0):
        np.testing.assert_array_equal(new_state[s], state[s])  # no tokens: state kept


@pytest.mark.parametrize(
    "dtype,lens,channels,width,with_bias",
    [
        ("f32", [7, 1, 0, 3], 37, 4, False),  # a sequence shorter than the window, an empty one
        ("f16", [2, 9], 64, 2, False),
        ("bf16", [0, 4, 1], 300, 3, False),  # two channel blocks, the second partial
        ("f16", [7, 1, 0, 3], 37, 4, True),  # a bias
    ],
)
def test_causal_conv1d(
    dtype: str, lens: list[int], channels: int, width: int, with_bias: bool
) -> None:
    import mlx.core as mx

    from vllm_metal.ops.short_conv import reference as ref

    rng = np.random.default_rng(channels + width)
    T, S = sum(lens), len(lens)
    x = O.quantize(rng.standard_normal((T, channels)), dtype)
    weight = O.quantize(rng.standard_normal((channels, width)) * 0.5, dtype)
    conv_state = O.quantize(rng.standard_normal((S, width - 1, channels)), dtype)
    bias = O.quantize(rng.standard_normal(channels), dtype) if with_bias else None
    cu = _cu(lens)
    y, new_state = K.causal_conv1d(x, weight, conv_state, cu, dtype, bias)
    args = [x, weight, conv_state, cu] + ([bias] if with_bias else [])
    want_y, want_state = ref.causal_conv1d(*(mx.array(a) for a in args))
    assert_close(y, np.array(want_y), dtype, "y")
    np.testing.assert_array_equal(new_state, np.array(want_state))  # windows are copies


@pytest.mark.parametrize(
    "dtype,lens,h,g,p,n",
    [
        ("f16", [7, 1, 0, 3], 4, 2, 64, 128),  # two heads per group, an empty sequence
        ("f32", [3, 0, 5], 3, 1, 5, 37),  # odd sizes: partial lanes, partial row block
        ("bf16", [1, 1, 1], 4, 4, 6, 256),  # decode rows, one head per group, the widest state
        ("f32", [4, 2], 4, 1, 32, 16),  # one group for all heads, a state narrower than a simdgroup
    ],
)
def test_mamba2_scan(dtype: str, lens: list[int], h: int, g: int, p: int, n: int) -> None:
    import mlx.core as mx

    from vllm_metal.ops.mamba2 import reference as ref

    rng = np.random.default_rng(p * n + h + g)
    T, S = sum(lens), len(lens)
    x = O.quantize(rng.standard_normal((T, h, p)), dtype)
    dt = rng.uniform(0.01, 0.5, (T, h)).astype(np.float32)
    A = -rng.uniform(0.5, 4.0, h).astype(np.float32)
    B = O.quantize(rng.standard_normal((T, g, n)), dtype)
    C = O.quantize(rng.standard_normal((T, g, n)) / np.sqrt(n), dtype)
    D = rng.standard_normal(h).astype(np.float32)
    state = (rng.standard_normal((S, h, p, n)) * 0.5).astype(np.float32)
    cu = _cu(lens)
    y, new_state = K.mamba2_scan(x, dt, A, B, C, D, state, cu, dtype)
    want_y, want_state = ref.mamba2_scan(*(mx.array(a) for a in (x, dt, A, B, C, D, state, cu)))
    assert_close(y, np.array(want_y), dtype, "y")
    assert_close(new_state, np.array(want_state), "f32", "state")
    for s in np.flatnonzero(np.asarray(lens) == 0):
        np.testing.assert_array_equal(new_state[s], state[s])  # no tokens: state kept


# ---------------------------------------------------------------------------------------------
# mla_attention and mla_reshape_and_cache (the references of vllm_metal/ops/mla)
# ---------------------------------------------------------------------------------------------


def _mla_case(
    dtype: str,
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    latent_dim: int,
    block_size: int,
    padding: int,
    seed: int,
) -> dict:
    """Random MLA inputs: shuffled block tables whose unused entries name a NaN block, and NaN in
    every cache row past a sequence's length (a kernel reading a row it must not shows)."""
    rng = np.random.default_rng(seed)
    S = len(seq_lens)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = S * max_blocks + 1
    perm = rng.permutation(num_blocks)
    cache = np.full((num_blocks, block_size, latent_dim), np.nan, np.float32)
    tables = np.full((S, max_blocks), perm[-1], np.int32)
    for s, L in enumerate(seq_lens):
        for b in range(-(-L // block_size)):
            block = perm[s * max_blocks + b]
            tables[s, b] = block
            used = min(block_size, L - b * block_size)
            cache[block, :used] = O.quantize(rng.standard_normal((used, latent_dim)), dtype)
    T = sum(q_lens) + padding
    return {
        "query": O.quantize(rng.standard_normal((T, heads, latent_dim)), dtype),
        "latent_cache": cache,
        "block_tables": tables,
        "seq_lens": np.asarray(seq_lens, np.int32),
        "cu_seqlens_q": _cu(q_lens),
    }


MLA_CASES = [
    # dtype, (latent_dim, value_dim), heads, block_size, q_lens, seq_lens, padding rows
    ("f32", (288, 256), 3, 8, [1, 6, 1, 0], [40, 6, 23, 5], 2),  # one partial head group
    ("f16", (288, 256), 10, 16, [1, 1, 1], [1, 70, 33], 0),  # decode rows, two head groups
    ("bf16", (288, 256), 8, 32, [5, 1], [50, 97], 1),  # chunked prefill with history
    ("f16", (576, 512), 2, 16, [1, 3], [45, 20], 1),  # DeepSeek's sizes
]


@pytest.mark.parametrize("dtype,sizes,heads,block_size,q_lens,seq_lens,padding", MLA_CASES)
def test_mla_attention(
    dtype: str,
    sizes: tuple[int, int],
    heads: int,
    block_size: int,
    q_lens: list[int],
    seq_lens: list[int],
    padding: int,
) -> None:
    import mlx.core as mx

    from vllm_metal.ops.mla import reference as ref

    latent_dim, value_dim = sizes
    case = _mla_case(dtype, q_lens, seq_lens, heads, latent_dim, block_size, padding, heads)
    scale = 1.5 / np.sqrt(latent_dim)
    got = K.mla_attention(**case, scale=scale, value_dim=value_dim, dtype=dtype)
    want = ref.mla_attention(*(mx.array(case[k]) for k in case), scale=scale, value_dim=value_dim)
    assert_close(got, np.array(want), dtype, "out")
    if padding:
        np.testing.assert_array_equal(got[-padding:], 0.0)  # tokens outside every sequence


@pytest.mark.parametrize("dtype", O.DTYPES)
def test_mla_reshape_and_cache(dtype: str) -> None:
    import mlx.core as mx

    from vllm_metal.ops.mla import reference as ref

    rng = np.random.default_rng(len(dtype))
    num_blocks, block_size, latent_dim = 5, 16, 576
    latent = O.quantize(rng.standard_normal((8, latent_dim)), dtype)
    cache = O.quantize(rng.standard_normal((num_blocks, block_size, latent_dim)), dtype)
    n = num_blocks * block_size
    # Slot 0, the last slot, padding (-1, -7) and an out-of-range slot.
    slots = np.array([0, 17, -1, n - 1, n, 33, -7, 5], np.int64)
    got = K.mla_reshape_and_cache(latent, cache, slots, dtype)
    want = ref.mla_reshape_and_cache(mx.array(latent), mx.array(cache), mx.array(slots))
    np.testing.assert_array_equal(got, np.array(want))


# ---------------------------------------------------------------------------------------------
# rotary_embedding (the reference of vllm_metal/ops/rope)
# ---------------------------------------------------------------------------------------------


def _rope_cache(max_position: int, rotary_dim: int) -> np.ndarray:
    """vLLM's cos/sin cache (base 10000): row p = cos(p f_i) then sin(p f_i)."""
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    freqs = np.outer(np.arange(max_position), inv_freq)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)


def _rope_heads(
    rng: np.random.Generator, layout: str, T: int, hq: int, hkv: int, d: int, dtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """query [T, Hq, D] and key [T, Hkv, D]: contiguous arrays; views of one fused QKV buffer
    (same strides); or a token-major query whose heads are T rows apart and a key cut out of a
    wider buffer (strides differing from the query's)."""

    def buffer(*shape: int) -> np.ndarray:  # owns its memory: the views below look into it
        return O.quantize(rng.standard_normal(shape), dtype).copy()

    if layout == "fused":
        qkv = buffer(T, hq + 2 * hkv, d)
        return qkv[:, :hq], qkv[:, hq : hq + hkv]
    if layout == "strided":
        wide = buffer(T, hkv + 2, d + 4)
        return np.swapaxes(buffer(hq, T, d), 0, 1), wide[:, 1 : 1 + hkv, 2 : 2 + d]
    return buffer(T, hq, d), buffer(T, hkv, d)


ROPE_CASES = [
    # dtype, cache dtype, neox, T, Hq, Hkv, D, rotary_dim, positions dtype, layout
    ("f32", "f32", True, 5, 4, 4, 64, 64, np.int64, "contiguous"),  # full rotary, MHA
    ("f16", "f16", False, 4, 8, 2, 80, 32, np.int32, "contiguous"),  # GPT-J, partial, GQA 4
    ("bf16", "f32", True, 3, 6, 1, 128, 64, np.int64, "fused"),  # float32 cache, 2 threadgroups
    ("f16", "f32", False, 6, 3, 1, 67, 24, np.int32, "strided"),  # odd head size: odd tail
    ("bf16", "bf16", True, 2, 5, 3, 96, 48, np.int32, "strided"),  # partial neox, strided
    ("f32", "f32", False, 2, 12, 4, 128, 128, np.int64, "fused"),  # GPT-J full, 4 threadgroups
]


@pytest.mark.parametrize("dtype,cache_dtype,neox,T,hq,hkv,d,rot,pos_dtype,layout", ROPE_CASES)
def test_rotary_embedding(
    dtype: str,
    cache_dtype: str,
    neox: bool,
    T: int,
    hq: int,
    hkv: int,
    d: int,
    rot: int,
    pos_dtype: type,
    layout: str,
) -> None:
    import mlx.core as mx

    from vllm_metal.ops.rope import reference as ref

    mx_dtype = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
    rng = np.random.default_rng(d + rot + T)
    max_position = 50
    query, key = _rope_heads(rng, layout, T, hq, hkv, d, dtype)
    cache = O.quantize(_rope_cache(max_position, rot), cache_dtype)
    positions = rng.integers(0, max_position, T).astype(pos_dtype)
    positions[0] = -3  # clamped to row 0
    positions[-1] = max_position + 7  # clamped to the last row
    got_q, got_k = K.rotary_embedding(positions, query, key, cache, neox, dtype, cache_dtype)
    want_q, want_k = ref.rotary_embedding(
        mx.array(positions),
        mx.array(np.ascontiguousarray(query)).astype(mx_dtype[dtype]),
        mx.array(np.ascontiguousarray(key)).astype(mx_dtype[dtype]),
        mx.array(cache).astype(mx_dtype[cache_dtype]),
        neox,
    )
    assert_close(got_q, np.array(want_q.astype(mx.float32)), dtype, "query")
    assert_close(got_k, np.array(want_k.astype(mx.float32)), dtype, "key")
    np.testing.assert_array_equal(got_q[..., rot:], query[..., rot:])  # passed through
    np.testing.assert_array_equal(got_k[..., rot:], key[..., rot:])
