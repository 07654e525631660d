"""The native causal_conv1d matches its reference on varlen batches (an empty sequence, sequences
shorter than the window, odd channel counts, a bias, mixed dtypes, strided inputs, a call large
enough for the thread pool) in every dtype, and the public entry point dispatches to it.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from state_ops import (
    DTYPES,
    as_f32,
    assert_empty_keep_state,
    assert_y_close,
    cu_seqlens,
    on_threads,
    spy_native,
    transposed_view,
)

from vllm_metal.ops.short_conv import causal_conv1d, reference


def make_args(
    rng: np.random.Generator,
    lens: list[int],
    channels: int,
    width: int,
    dtype: str,
    weight_dtype: str | None = None,
    state_dtype: str | None = None,
    bias_dtype: str | None = None,
) -> list[mx.array]:
    """x, weight, conv_state, cu_seqlens, and a bias [C] when ``bias_dtype`` is given."""
    t, s = sum(lens), len(lens)
    x = mx.array(rng.standard_normal((t, channels)).astype(np.float32))
    weight = mx.array((rng.standard_normal((channels, width)) * 0.5).astype(np.float32))
    state = mx.array(rng.standard_normal((s, width - 1, channels)).astype(np.float32))
    cu = mx.array(cu_seqlens(lens))
    args = [
        x.astype(DTYPES[dtype]),
        weight.astype(DTYPES[weight_dtype or dtype]),
        state.astype(DTYPES[state_dtype or dtype]),
        cu,
    ]
    if bias_dtype is not None:
        args.append(
            mx.array(rng.standard_normal(channels).astype(np.float32)).astype(DTYPES[bias_dtype])
        )
    return args


def check(got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array], dtype: str) -> None:
    """y within the tolerance of the dtype (state_ops.Y_TOL); the new windows are copies of
    inputs: exact."""
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert_y_close(got[0], want[0], dtype)
    np.testing.assert_array_equal(as_f32(got[1]), as_f32(want[1]))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "lens,channels,width",
    [
        ([7, 1, 0, 3], 64, 4),  # a sequence shorter than the window, an empty one
        ([2, 0, 9], 37, 2),  # odd channel count, the narrowest window
        ([1, 1, 1], 96, 4),  # decode rows
    ],
)
def test_matches_reference(
    native: ModuleType, dtype: str, lens: list[int], channels: int, width: int
) -> None:
    args = make_args(np.random.default_rng(channels + width), lens, channels, width, dtype)
    got = native.causal_conv1d(*args)
    mx.eval(*got)
    check(got, reference.causal_conv1d(*args), dtype)
    assert_empty_keep_state(lens, got[1], args[2])


@pytest.mark.parametrize(
    "dtype,weight_dtype,state_dtype",
    [("bfloat16", "float32", "float32"), ("float32", "float16", "bfloat16")],
)
def test_mixed_dtypes(native: ModuleType, dtype: str, weight_dtype: str, state_dtype: str) -> None:
    args = make_args(np.random.default_rng(5), [5, 2], 24, 4, dtype, weight_dtype, state_dtype)
    check(native.causal_conv1d(*args), reference.causal_conv1d(*args), dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("lens,channels,width", [([7, 1, 0, 3], 64, 4), ([2, 0, 9], 37, 2)])
def test_bias_matches_reference(
    native: ModuleType, dtype: str, lens: list[int], channels: int, width: int
) -> None:
    rng = np.random.default_rng(channels + width + 1)
    args = make_args(rng, lens, channels, width, dtype, bias_dtype=dtype)
    got = native.causal_conv1d(*args)
    check(got, reference.causal_conv1d(*args), dtype)
    # The bias is applied: without it the outputs differ.
    assert not np.allclose(as_f32(got[0]), as_f32(native.causal_conv1d(*args[:4])[0]), atol=0.1)


@pytest.mark.parametrize("dtype,bias_dtype", [("bfloat16", "float32"), ("float32", "float16")])
def test_bias_of_another_dtype(native: ModuleType, dtype: str, bias_dtype: str) -> None:
    args = make_args(np.random.default_rng(6), [5, 2], 24, 4, dtype, bias_dtype=bias_dtype)
    check(native.causal_conv1d(*args), reference.causal_conv1d(*args), dtype)


def test_no_tokens_at_all(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(0), [0, 0], 8, 3, "float16")
    y, state = native.causal_conv1d(*args)
    assert y.shape == (0, 8)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(args[2]))


def test_strided_inputs(native: ModuleType) -> None:
    # x a slice of a fused projection, weight and state transposed views.
    args = make_args(np.random.default_rng(1), [4, 6], 16, 4, "float32")
    args[0] = mx.concatenate([args[0], args[0]], axis=-1)[:, 16:]
    args[1] = transposed_view(args[1], 0, 1)
    args[2] = transposed_view(args[2], 1, 2)
    check(native.causal_conv1d(*args), reference.causal_conv1d(*args), "float32")


def test_large_call_uses_threads_and_matches(native: ModuleType) -> None:
    args = make_args(
        np.random.default_rng(2), [150, 0, 3, 180], 256, 4, "bfloat16", None, None, "bfloat16"
    )
    want = reference.causal_conv1d(*args)
    mx.eval(*want)
    check(on_threads(native, native.causal_conv1d, args), want, "bfloat16")


def test_entry_point_dispatches_to_native(native: ModuleType, monkeypatch) -> None:
    args = make_args(np.random.default_rng(3), [3, 2], 8, 4, "float16", bias_dtype="float16")
    calls = spy_native(native, "causal_conv1d", monkeypatch)
    check(causal_conv1d(*args[:4]), reference.causal_conv1d(*args[:4]), "float16")
    check(causal_conv1d(*args), reference.causal_conv1d(*args), "float16")
    assert calls == [5, 5]


def test_metal_plan(native: ModuleType) -> None:
    from vllm_metal import _C

    most = _C.CONSTANTS["SHORT_CONV_MAX_THREADS"]
    plan = _C.select_causal_conv1d_kernel("f16", 10, 3, most + 1, 4)
    assert plan == {"kernel": "causal_conv1d_f16", "threads": most, "grid": [2, 10 + 3 * 3, 1]}
    assert _C.select_causal_conv1d_kernel("f32", 1, 1, 37, 2)["threads"] == 64
    with pytest.raises(ValueError, match="dtype"):
        _C.select_causal_conv1d_kernel("f64", 1, 1, 8, 2)
