"""Proves the MSL harness itself: correct results for collectives, simdgroup matrices, tensor ops
and conversions, and a reported failure for every planted defect (races, bounds, divergence)."""

from __future__ import annotations

import numpy as np
import pytest

from . import harness
from . import oracle as O

pytestmark = pytest.mark.msl

FIXTURES = harness.HERE / "fixtures"


@pytest.fixture(scope="module")
def reduce_prog() -> harness.Program:
    return harness.compile_source(FIXTURES / "reduce.metal")


@pytest.fixture(scope="module")
def matrix_prog() -> harness.Program:
    return harness.compile_source(FIXTURES / "matrix.metal")


def run1(prog, kernel, grid, threads, buffers, binds, outputs, tg=None):
    return harness.run(
        prog, buffers, [harness.Dispatch(kernel, grid, threads, binds, tg or {})], outputs
    )


@pytest.mark.parametrize(
    "kernel,dtype,block",
    [
        ("block_sum_float_128", "f32", 128),
        ("block_sum_half_256", "f16", 256),
        ("block_sum_bfloat_64", "bf16", 64),
    ],
)
def test_block_sum(reduce_prog, kernel: str, dtype: str, block: int) -> None:
    rng = np.random.default_rng(block)
    n = 1000
    x = O.quantize(rng.standard_normal(n), dtype)
    groups = -(-n // block)
    r = run1(
        reduce_prog,
        kernel,
        (groups, 1, 1),
        (block, 1, 1),
        {"x": O.to_device(x, dtype), "o": np.zeros(groups, np.float32)},
        {0: "x", 1: "o", 2: np.array(n, np.uint32)},
        ["o"],
    )
    want = np.add.reduceat(x.astype(np.float64), np.arange(0, n, block))
    np.testing.assert_allclose(r["o"], want, rtol=1e-5, atol=1e-4)


def test_shuffles_and_dynamic_threadgroup_memory(reduce_prog) -> None:
    x = np.arange(64, dtype=np.float32)
    r = run1(
        reduce_prog,
        "reverse_shuffle",
        (1, 1, 1),
        (64, 1, 1),
        {"x": x, "o": np.zeros(64, np.float32)},
        {0: "x", 1: "o"},
        ["o"],
        {0: 256},
    )
    lane = np.arange(64) % 32
    down = np.where(lane < 31, 0.5 * (lane + 1), 0.5 * lane)  # shuffle_down keeps the top lane
    v = x[np.arange(64) ^ 1] + down
    np.testing.assert_array_equal(r["o"], v[::-1])


@pytest.mark.parametrize(
    "kernel,threads,binds,tg,kind",
    [
        ("block_sum_no_barrier", 128, {0: "x", 1: "o"}, None, "threadgroup-"),
        ("read_past_end", 64, {0: "x64", 1: "o"}, None, "device-out-of-bounds"),
        ("write_conflict", 64, {0: "o"}, None, "device-race"),
        ("divergent_barrier", 64, {0: "o"}, None, "barrier-divergence"),
        ("divergent_simd", 32, {0: "o"}, None, "simdgroup-divergence"),
        ("uninitialized_threadgroup", 64, {0: "o"}, None, "threadgroup-uninitialized"),
        ("reverse_shuffle", 64, {0: "x", 1: "o"}, {0: 128}, "threadgroup-out-of-bounds"),
        ("reverse_shuffle", 64, {0: "x", 1: "o"}, None, "binding"),
    ],
)
def test_planted_defects_are_reported(reduce_prog, kernel, threads, binds, tg, kind) -> None:
    bufs = {
        "x": np.ones(256, np.float32),
        "x64": np.ones(64, np.float32),
        "o": np.zeros(256, np.float32),
    }
    with pytest.raises(harness.MslRuntimeError) as e:
        run1(reduce_prog, kernel, (1, 1, 1), (threads, 1, 1), bufs, binds, ["o"], tg)
    assert e.value.kind.startswith(kind), str(e.value)
    if kind != "binding":
        assert "reduce.metal:" in str(e.value), "the report names the kernel source line"


@pytest.mark.parametrize(
    "kernel,dtype,transpose",
    [("mma8_f32", "f32", False), ("mma8_f16_t", "f16", True), ("mma8_bf16", "bf16", False)],
)
def test_simdgroup_matrix(matrix_prog, kernel: str, dtype: str, transpose: bool) -> None:
    rng = np.random.default_rng(1)
    k = 24
    a = O.quantize(rng.standard_normal((8, k)), dtype)
    b = O.quantize(rng.standard_normal((k, 8)), dtype)
    b_buf = b.T.copy() if transpose else b
    r = run1(
        matrix_prog,
        kernel,
        (1, 1, 1),
        (32, 1, 1),
        {
            "a": O.to_device(a, dtype),
            "b": O.to_device(b_buf, dtype),
            "c": np.zeros((8, 8), np.float32),
        },
        {0: "a", 1: "b", 2: "c", 3: np.array(k, np.uint32)},
        ["c"],
    )
    want = (a.astype(np.float64) @ b) * (np.arange(8)[:, None] + 1) * 2
    np.testing.assert_allclose(r["c"], want, rtol=1e-5, atol=1e-4)


def test_tensor_matmul_cooperative(matrix_prog) -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((16, 32)).astype(np.float16)
    b = rng.standard_normal((32, 32)).astype(np.float16)
    r = run1(
        matrix_prog,
        "tensor_matmul",
        (1, 1, 1),
        (128, 1, 1),
        {"a": a, "b": b, "c": np.zeros((16, 32), np.float32)},
        {0: "a", 1: "b", 2: "c"},
        ["c"],
    )
    want = (a.astype(np.float64) @ b.astype(np.float64).T) * (np.arange(16)[:, None] + 1)
    np.testing.assert_allclose(r["c"], want, rtol=1e-4, atol=1e-3)


def test_conversions_round_to_nearest_even(matrix_prog) -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [
            rng.standard_normal(200).astype(np.float32) * 1e3,
            # exact ties between two bfloat16 values (low 16 bits 0x8000), both parities
            (np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x47FF8000], np.uint32)).view(
                np.float32
            ),
            np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 1e-8], np.float32),
        ]
    ).astype(np.float32)
    n = len(x)
    r = run1(
        matrix_prog,
        "convert",
        (1, 1, 1),
        (n, 1, 1),
        {"x": x, "bf": np.zeros(n, np.uint16), "h": np.zeros(n, np.float16)},
        {0: "x", 1: "bf", 2: "h"},
        ["bf", "h"],
    )
    np.testing.assert_array_equal(r["bf"], O.to_device(x, "bf16"))
    with np.errstate(over="ignore"):  # values past the half range become inf, as on the GPU
        want_h = x.astype(np.float16)
    np.testing.assert_array_equal(r["h"].view(np.uint16), want_h.view(np.uint16))


def test_source_mapping_keeps_lines_and_only_rewrites_declarations() -> None:
    src = (
        "kernel void f(threadgroup float* p [[threadgroup(0)]],\n"
        "              device half* d [[buffer(1)]]) {\n"
        "  threadgroup float buf[4][8];\n"
        "  threadgroup half* q = (threadgroup half*)p;\n"
        "  threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "}\n"
    )
    out = harness.map_source(src, "x.metal").split("\n", 1)[1]
    assert out.count("\n") == src.count("\n")
    assert "[[msl_threadgroup(0)]]" in out
    assert (
        "auto& buf = ::msl::tg_var<float[4][8]>(__COUNTER__, "
        '[] { return ::msl::rt::TgDecl{"buf", __FILE__, __LINE__}; });'
    ) in out
    assert "threadgroup half* q = (threadgroup half*)p;" in out
    assert "threadgroup_barrier(mem_flags::mem_threadgroup);" in out
