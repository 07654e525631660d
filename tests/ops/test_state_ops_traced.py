"""The recurrent ops of hybrid models (gated_delta_rule, causal_conv1d, mamba2_scan) with
`max_query_len`: a decode step's rows, one per sequence, or a verifying step's, three per
sequence, traced by `mx.compile` (what a compiled step of a hybrid runs) equal the untraced op, on the native ops and on their pure-MLX
references (the GPU proxy's path, which then reads nothing on the host); a wrong
`max_query_len` is refused by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal import ops

S, H, DK, DV = 5, 4, 16, 8  # sequences (one row each), heads, key and value widths


def _rand(rng, *shape, scale=1.0):
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def _cases(rng, rows=1):
    """name -> (the op, its arguments up to cu_seqlens, its keyword arguments), for S
    sequences of `rows` rows each."""
    T = S * rows
    cu = mx.array(np.arange(S + 1, dtype=np.int32) * rows)
    g = mx.array(rng.uniform(0.5, 1.0, (T, H)).astype(np.float32))
    channel_g = mx.array(rng.uniform(0.5, 1.0, (T, H, DK)).astype(np.float32))
    beta = mx.array(rng.uniform(0.0, 1.0, (T, H)).astype(np.float32))
    delta = (_rand(rng, T, H, DK), _rand(rng, T, H, DK), _rand(rng, T, H, DV))
    window = (_rand(rng, T, 12), _rand(rng, 12, 4), _rand(rng, S, 3, 12), cu, _rand(rng, 12))
    dt = mx.array(rng.uniform(0.01, 0.5, (T, H)).astype(np.float32))
    A = mx.array(-rng.uniform(0.5, 2.0, H).astype(np.float32))
    return {
        "gated_delta": (ops.gated_delta_rule, (*delta, g, beta, _rand(rng, S, H, DV, DK), cu), {}),
        "gated_delta_per_channel": (
            ops.gated_delta_rule, (*delta, channel_g, beta, _rand(rng, S, H, DV, DK), cu), {},
        ),
        "conv_silu": (ops.causal_conv1d, window, {}),
        "conv_plain": (ops.causal_conv1d, window, {"silu": False}),
        "mamba2": (
            ops.mamba2_scan,
            (_rand(rng, T, H, DV), dt, A, _rand(rng, T, 2, DK), _rand(rng, T, 2, DK),
             _rand(rng, H), _rand(rng, S, H, DV, DK), cu),
            {},
        ),
    }  # fmt: skip


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize(
    "name", ["gated_delta", "gated_delta_per_channel", "conv_silu", "conv_plain", "mamba2"]
)
def test_a_step_traced_by_compile_equals_the_op(monkeypatch, name, reference_ops, rows):
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    op, args, kwargs = _cases(np.random.default_rng(len(name)), rows)[name]
    want = op(*args, **kwargs)
    traced = mx.compile(lambda *a: op(*a, max_query_len=rows, **kwargs))
    got = traced(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_max_query_len_is_checked():
    op, args, _ = _cases(np.random.default_rng(0))["mamba2"]
    with pytest.raises(ValueError, match="max_query_len must be a positive integer"):
        op(*args, max_query_len=True)
    with pytest.raises(ValueError, match=r"max_query_len=2 gives 5 sequences 10 rows"):
        op(*args, max_query_len=2)
