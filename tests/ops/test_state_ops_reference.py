"""The references of the state-layer ops against independent implementations: mlx-lm's own gated
delta recurrence (`gated_delta_ops`) and Mamba-2 scan (`ssm_attn`, its chunked SSD form), one
sequence at a time, and MLX's depthwise `nn.Conv1d` over each sequence's window and tokens.
Varlen batches with grouped heads and an empty sequence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from vllm_metal.ops import reference

LENGTHS = [5, 1, 0, 3]


def _cu() -> tuple[mx.array, np.ndarray]:
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    return mx.array(cu), cu


@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_delta_rule_reference_matches_mlx_lm_per_sequence(per_channel):
    """Per-head decay (Qwen3-Next) and per-key-channel decay (Kimi Delta Attention), the second
    through the op's entry (the native kernel takes only the first)."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    from vllm_metal import ops

    cu_mx, cu = _cu()
    t, hk, hv, dk, dv = int(cu[-1]), 1, 2, 16, 8
    rng = np.random.default_rng(0)

    def rand(*shape, lo=None, hi=None):
        if lo is None:
            return mx.array(rng.standard_normal(shape).astype(np.float32))
        return mx.array(rng.uniform(lo, hi, shape).astype(np.float32))

    q, k, v = rand(t, hk, dk), rand(t, hk, dk) * 0.3, rand(t, hv, dv)
    g = rand(t, hv, dk, lo=0.3, hi=1.0) if per_channel else rand(t, hv, lo=0.5, hi=1.0)
    beta = rand(t, hv, lo=0.0, hi=1.0)
    state = rand(len(LENGTHS), hv, dv, dk)
    run = ops.gated_delta_rule if per_channel else reference.gated_delta_rule
    y, new_state = run(q, k, v, g, beta, state, cu_mx)
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


@pytest.mark.parametrize(("with_bias", "silu"), [(False, True), (True, True), (True, False)])
def test_causal_conv1d_reference_matches_mlx_conv1d_per_sequence(with_bias, silu):
    cu_mx, cu = _cu()
    channels, width = 8, 4
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((int(cu[-1]), channels)).astype(np.float32))
    weight = mx.array(rng.standard_normal((channels, width)).astype(np.float32))
    window = mx.array(rng.standard_normal((len(LENGTHS), width - 1, channels)).astype(np.float32))
    bias = mx.array(rng.standard_normal(channels).astype(np.float32)) if with_bias else None
    y, new_window = reference.causal_conv1d(x, weight, window, cu_mx, bias, silu=silu)
    if not silu:  # the op's entry routes the sums (LFM2's) to this same reference
        from vllm_metal import ops

        entry = ops.causal_conv1d(x, weight, window, cu_mx, bias, silu=False)
        np.testing.assert_array_equal(np.array(entry[0]), np.array(y))
    conv = nn.Conv1d(channels, channels, width, groups=channels, bias=with_bias)
    conv.weight = weight[:, :, None]  # MLX's [out, kernel, in / groups]
    if with_bias:
        conv.bias = bias
    for s in range(len(LENGTHS)):
        a, b = cu[s], cu[s + 1]
        u = mx.concatenate([window[s], x[a:b]])
        if b > a:
            want = conv(u[None])[0]
            want = nn.silu(want) if silu else want
            np.testing.assert_allclose(np.array(y[a:b]), np.array(want), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.array(new_window[s]), np.array(u[-(width - 1) :]))


@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_scan_reference_matches_mlx_lm_ssd_per_sequence(groups):
    from mlx_lm.models.ssm import compute_dt, ssm_attn

    cu_mx, cu = _cu()
    t, heads, head_dim, state_size = int(cu[-1]), 4, 8, 16
    rng = np.random.default_rng(2)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    x, dt_raw, dt_bias, D = rand(t, heads, head_dim), rand(t, heads), rand(heads), rand(heads)
    B, C = rand(t, groups, state_size), rand(t, groups, state_size)
    A_log = mx.log(mx.arange(1, heads + 1).astype(mx.float32))
    state = rand(len(LENGTHS), heads, head_dim, state_size)
    dt = compute_dt(dt_raw, dt_bias, (0.001, 100.0))
    y, new_state = reference.mamba2_scan(x, dt, -mx.exp(A_log), B, C, D, state, cu_mx)
    for s in range(len(LENGTHS)):
        a, b = cu[s], cu[s + 1]
        if a == b:
            np.testing.assert_array_equal(np.array(new_state[s]), np.array(state[s]))
            continue
        want_y, want_state = ssm_attn(
            x[None, a:b], A_log, B[None, a:b], C[None, a:b], D, dt_raw[None, a:b], dt_bias,
            state[s : s + 1],
        )  # fmt: skip
        np.testing.assert_allclose(np.array(y[a:b]), np.array(want_y[0]), atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(
            np.array(new_state[s]), np.array(want_state[0]), atol=2e-5, rtol=2e-5
        )
