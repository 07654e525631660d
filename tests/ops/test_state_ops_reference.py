"""The references of the state-layer ops against independent implementations: mlx-lm's own gated
delta recurrence (`gated_delta_ops`, one sequence at a time) and MLX's depthwise `nn.Conv1d` over
each sequence's window and tokens. Varlen batches with GQA value heads and an empty sequence."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn
import numpy as np

from vllm_metal.ops import reference

LENGTHS = [5, 1, 0, 3]


def _cu() -> tuple[mx.array, np.ndarray]:
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    return mx.array(cu), cu


def test_gated_delta_rule_reference_matches_mlx_lm_per_sequence():
    from mlx_lm.models.gated_delta import gated_delta_ops

    cu_mx, cu = _cu()
    t, hk, hv, dk, dv = int(cu[-1]), 1, 2, 16, 8
    rng = np.random.default_rng(0)

    def rand(*shape, lo=None, hi=None):
        if lo is None:
            return mx.array(rng.standard_normal(shape).astype(np.float32))
        return mx.array(rng.uniform(lo, hi, shape).astype(np.float32))

    q, k, v = rand(t, hk, dk), rand(t, hk, dk) * 0.3, rand(t, hv, dv)
    g, beta = rand(t, hv, lo=0.5, hi=1.0), rand(t, hv, lo=0.0, hi=1.0)
    state = rand(len(LENGTHS), hv, dv, dk)
    y, new_state = reference.gated_delta_rule(q, k, v, g, beta, state, cu_mx)
    assert y.shape == (t, hv, dv)
    for s in range(len(LENGTHS)):
        a, b = cu[s], cu[s + 1]
        if a == b:
            np.testing.assert_array_equal(np.array(new_state[s]), np.array(state[s]))
            continue
        want_y, want_state = gated_delta_ops(
            q[None, a:b],
            k[None, a:b],
            v[None, a:b],
            g[None, a:b],
            beta[None, a:b],
            state[s : s + 1],
        )
        np.testing.assert_allclose(np.array(y[a:b]), np.array(want_y[0]), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(
            np.array(new_state[s]), np.array(want_state[0]), atol=1e-5, rtol=1e-5
        )


def test_causal_conv1d_reference_matches_mlx_conv1d_per_sequence():
    cu_mx, cu = _cu()
    channels, width = 8, 4
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((int(cu[-1]), channels)).astype(np.float32))
    weight = mx.array(rng.standard_normal((channels, width)).astype(np.float32))
    window = mx.array(rng.standard_normal((len(LENGTHS), width - 1, channels)).astype(np.float32))
    y, new_window = reference.causal_conv1d(x, weight, window, cu_mx)
    conv = nn.Conv1d(channels, channels, width, groups=channels, bias=False)
    conv.weight = weight[:, :, None]  # MLX's [out, kernel, in / groups]
    for s in range(len(LENGTHS)):
        a, b = cu[s], cu[s + 1]
        u = mx.concatenate([window[s], x[a:b]])
        if b > a:
            want = nn.silu(conv(u[None]))[0]
            np.testing.assert_allclose(np.array(y[a:b]), np.array(want), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.array(new_window[s]), np.array(u[-(width - 1) :]))
