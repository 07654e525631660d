"""The native gated_delta_rule matches its reference on varlen batches (an empty sequence, GQA,
odd sizes, decode rows, strided inputs, a call large enough for the thread pool) in every dtype,
and the public entry point dispatches to it.
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

from vllm_metal.ops.gated_delta import gated_delta_rule, reference


def make_args(
    rng: np.random.Generator, lens: list[int], hk: int, hv: int, dk: int, dv: int, dtype: str
) -> list[mx.array]:
    t, s = sum(lens), len(lens)
    k = rng.standard_normal((t, hk, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # as the models feed it (L2-normalised keys)
    q = rng.standard_normal((t, hk, dk)).astype(np.float32) / np.sqrt(dk)
    v = rng.standard_normal((t, hv, dv)).astype(np.float32)
    g = rng.uniform(0.3, 1.0, (t, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (t, hv)).astype(np.float32)
    state = (rng.standard_normal((s, hv, dv, dk)) * 0.5).astype(np.float32)
    cu = cu_seqlens(lens)
    dt = DTYPES[dtype]
    return [
        mx.array(q).astype(dt),
        mx.array(k).astype(dt),
        mx.array(v).astype(dt),
        mx.array(g),
        mx.array(beta),
        mx.array(state),
        mx.array(cu),
    ]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "lens,hk,hv,dk,dv",
    [
        ([7, 1, 0, 3], 2, 4, 64, 64),  # GQA Hv = 2 Hk, an empty sequence
        ([5, 0, 2], 1, 3, 7, 5),  # small odd sizes
        ([1, 1, 1, 1], 2, 2, 64, 32),  # decode rows
    ],
)
def test_matches_reference(
    native: ModuleType, dtype: str, lens: list[int], hk: int, hv: int, dk: int, dv: int
) -> None:
    args = make_args(np.random.default_rng(dk * dv + hv), lens, hk, hv, dk, dv, dtype)
    got = native.gated_delta_rule(*args)
    mx.eval(*got)
    check(got, reference.gated_delta_rule(*args), dtype)
    assert_empty_keep_state(lens, got[1], args[5])


def test_no_tokens_at_all(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(0), [0, 0], 1, 2, 8, 4, "float32")
    y, state = native.gated_delta_rule(*args)
    assert y.shape == (0, 2, 4)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(args[5]))


def test_strided_inputs(native: ModuleType) -> None:
    # q and k slices of one fused projection, v a slice too, the state a transposed view.
    args = make_args(np.random.default_rng(1), [4, 3], 2, 4, 16, 16, "float32")
    qk = mx.concatenate(args[:2], axis=-1)
    args[0], args[1] = qk[..., :16], qk[..., 16:]
    args[2] = mx.concatenate([args[2], args[2]], axis=-1)[..., :16]
    args[5] = transposed_view(args[5], 2, 3)
    check(native.gated_delta_rule(*args), reference.gated_delta_rule(*args), "float32")


def test_large_call_uses_threads_and_matches(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(2), [40, 0, 25, 31], 2, 4, 64, 64, "bfloat16")
    want = reference.gated_delta_rule(*args)
    mx.eval(*want)
    check(on_threads(native, native.gated_delta_rule, args), want, "bfloat16")


def test_entry_point_dispatches_to_native(native: ModuleType, monkeypatch) -> None:
    args = make_args(np.random.default_rng(3), [3, 2], 1, 2, 8, 8, "float16")
    calls = spy_native(native, "gated_delta_rule", monkeypatch)
    check(gated_delta_rule(*args), reference.gated_delta_rule(*args), "float16")
    assert calls == [7]


def test_metal_plan(native: ModuleType) -> None:
    from vllm_metal import _C

    rows, max_dk = _C.CONSTANTS["GATED_DELTA_ROWS"], _C.CONSTANTS["GATED_DELTA_MAX_KEY_DIM"]
    plan = _C.select_gated_delta_rule_kernel("bf16", 6, max_dk, 2 * rows + 1, 3)
    assert plan == {"kernel": "gated_delta_rule_bf16", "threads": rows * 32, "grid": [3, 6, 3]}
    with pytest.raises(ValueError, match="key head dims"):
        _C.select_gated_delta_rule_kernel("f16", 1, max_dk + 1, 8, 1)
