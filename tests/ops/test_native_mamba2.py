"""The native mamba2_scan matches its reference on varlen batches (an empty sequence, grouped B/C
with G = 2 and G = 1, odd sizes, decode rows, state sizes 16 to 128, strided inputs, a call large
enough for the thread pool) in every dtype, and the public entry point dispatches to it.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from state_ops import (
    DTYPES,
    assert_empty_keep_state,
    cu_seqlens,
    on_threads,
    spy_native,
    transposed_view,
)
from state_ops import check_recurrence as check

from vllm_metal.ops.mamba2 import mamba2_scan, reference


def make_args(
    rng: np.random.Generator, lens: list[int], h: int, g: int, p: int, n: int, dtype: str
) -> list[mx.array]:
    """x, dt, A, B, C, D, state, cu_seqlens, scaled as a model feeds them (dt after softplus,
    A negative)."""
    t, s = sum(lens), len(lens)
    x = rng.standard_normal((t, h, p)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, (t, h)).astype(np.float32)
    A = -rng.uniform(0.5, 4.0, h).astype(np.float32)
    B = rng.standard_normal((t, g, n)).astype(np.float32)
    C = (rng.standard_normal((t, g, n)) / np.sqrt(n)).astype(np.float32)
    D = rng.standard_normal(h).astype(np.float32)
    state = (rng.standard_normal((s, h, p, n)) * 0.5).astype(np.float32)
    cu = cu_seqlens(lens)
    dt_ = DTYPES[dtype]
    return [
        mx.array(x).astype(dt_),
        mx.array(dt),
        mx.array(A),
        mx.array(B).astype(dt_),
        mx.array(C).astype(dt_),
        mx.array(D),
        mx.array(state),
        mx.array(cu),
    ]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "lens,h,g,p,n",
    [
        ([7, 1, 0, 3], 4, 2, 64, 128),  # two heads per group, an empty sequence
        ([7, 1, 0, 3], 4, 1, 32, 16),  # one group for all heads, a small state
        ([5, 0, 2], 3, 1, 5, 7),  # small odd sizes
        ([1, 1, 1, 1], 4, 2, 32, 64),  # decode rows
    ],
)
def test_matches_reference(
    native: ModuleType, dtype: str, lens: list[int], h: int, g: int, p: int, n: int
) -> None:
    args = make_args(np.random.default_rng(p * n + h + g), lens, h, g, p, n, dtype)
    got = native.mamba2_scan(*args)
    mx.eval(*got)
    check(got, reference.mamba2_scan(*args), dtype)
    assert_empty_keep_state(lens, got[1], args[6])


def test_no_tokens_at_all(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(0), [0, 0], 2, 1, 8, 16, "float32")
    y, state = native.mamba2_scan(*args)
    assert y.shape == (0, 2, 8)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(args[6]))


def test_strided_inputs(native: ModuleType) -> None:
    # x, B and C slices of one fused projection, dt a column slice, the state a transposed view.
    args = make_args(np.random.default_rng(1), [4, 3], 4, 2, 16, 32, "float32")
    t = args[0].shape[0]
    fused = mx.concatenate(
        [args[0].reshape(t, -1), args[3].reshape(t, -1), args[4].reshape(t, -1)], 1
    )
    args[0] = fused[:, :64].reshape(t, 4, 16)
    args[3] = fused[:, 64:128].reshape(t, 2, 32)
    args[4] = fused[:, 128:].reshape(t, 2, 32)
    args[1] = mx.concatenate([args[1], args[1]], axis=-1)[:, 4:]
    args[6] = transposed_view(args[6], 2, 3)
    check(native.mamba2_scan(*args), reference.mamba2_scan(*args), "float32")


def test_large_call_uses_threads_and_matches(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(2), [40, 0, 25, 31], 4, 2, 64, 128, "bfloat16")
    want = reference.mamba2_scan(*args)
    mx.eval(*want)
    check(on_threads(native, native.mamba2_scan, args), want, "bfloat16")


def test_entry_point_dispatches_to_native(native: ModuleType, monkeypatch) -> None:
    args = make_args(np.random.default_rng(3), [3, 2], 2, 1, 8, 16, "float16")
    calls = spy_native(native, "mamba2_scan", monkeypatch)
    check(mamba2_scan(*args), reference.mamba2_scan(*args), "float16")
    assert calls == [8]


def test_metal_plan(native: ModuleType) -> None:
    from vllm_metal import _C

    rows, max_n = _C.CONSTANTS["MAMBA2_ROWS"], _C.CONSTANTS["MAMBA2_MAX_STATE_DIM"]
    plan = _C.select_mamba2_scan_kernel("bf16", 6, 2 * rows + 1, max_n, 3)
    assert plan == {"kernel": "mamba2_scan_bf16", "threads": rows * 32, "grid": [3, 6, 3]}
    with pytest.raises(ValueError, match="state sizes"):
        _C.select_mamba2_scan_kernel("f16", 1, 8, max_n + 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        _C.select_mamba2_scan_kernel("f64", 1, 8, 16, 1)
