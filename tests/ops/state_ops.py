"""Helpers of the state-layer ops' native tests (gated_delta_rule, mamba2_scan, causal_conv1d):
varlen offsets, the tolerance checks of y and of the carried state, non-contiguous views, and
calls on a pinned thread count or through the public entry point.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.ops import _backend

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# |native - reference| <= atol + rtol |reference| for y: both sum in float32 from the same inputs,
# y is rounded to the dtype once.
Y_TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 1e-3), "bfloat16": (1.5e-2, 8e-3)}
# The float32 states of the recurrences differ only by summation order.
STATE_TOL = (1e-4, 1e-5)

Pair = tuple[mx.array, mx.array]


def cu_seqlens(lens: Sequence[int]) -> np.ndarray:
    """The int32 offsets [S + 1] of sequences of these lengths."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def as_f32(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32))


def assert_y_close(got: mx.array, want: mx.array, dtype: str) -> None:
    atol, rtol = Y_TOL[dtype]
    np.testing.assert_allclose(as_f32(got), as_f32(want), atol=atol, rtol=rtol)


def check_recurrence(got: Pair, want: Pair, dtype: str) -> None:
    """(y, state) of a recurrence: y of the reference's dtype within Y_TOL, the float32 state
    within STATE_TOL."""
    assert got[0].dtype == want[0].dtype and got[1].dtype == mx.float32
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert_y_close(got[0], want[0], dtype)
    np.testing.assert_allclose(
        np.asarray(got[1]), np.asarray(want[1]), atol=STATE_TOL[0], rtol=STATE_TOL[1]
    )


def assert_empty_keep_state(lens: Sequence[int], new_state: mx.array, state: mx.array) -> None:
    """A sequence with no tokens keeps its state, bit for bit."""
    for s in np.flatnonzero(np.asarray(lens) == 0):
        np.testing.assert_array_equal(as_f32(new_state[int(s)]), as_f32(state[int(s)]))


def transposed_view(a: mx.array, axis1: int, axis2: int) -> mx.array:
    """`a`'s values as a non-contiguous view: two axes swapped back over a contiguous copy."""
    swapped = mx.array(np.ascontiguousarray(np.swapaxes(np.asarray(a), axis1, axis2)))
    return mx.swapaxes(swapped, axis1, axis2)


def on_threads(native: ModuleType, op: Callable[..., Pair], args: list, threads: int = 2) -> Pair:
    """op(*args) evaluated with the native thread pool at `threads`, then back to its default."""
    native.set_num_threads(threads)
    try:
        got = op(*args)
        mx.eval(*got)
    finally:
        native.set_num_threads(0)
    return got


def spy_native(native: ModuleType, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Routes the public entry points to `native` and records the argument count of each call of
    its op `name` in the returned list."""
    calls: list[int] = []
    monkeypatch.setattr(_backend, "native", lambda: native)
    real = getattr(native, name)
    monkeypatch.setattr(native, name, lambda *a: calls.append(len(a)) or real(*a))
    return calls
