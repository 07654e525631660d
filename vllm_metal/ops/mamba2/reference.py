"""Pure-MLX reference of mamba2_scan (the contract: vllm_metal.ops.mamba2).

Like the gated delta reference: the sequences are padded to the longest one and stepped together,
one token per step; rows past a sequence's end leave its state unchanged. Reads cu_seqlens on the
host, unless `max_query_len` gives every sequence's rows (a traced step's).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops._varlen import Lockstep


def mamba2_scan(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array,
    cu_seqlens: mx.array,
    max_query_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    t, h, _ = x.shape
    g = B.shape[1]
    steps = Lockstep(cu_seqlens, max_query_len)
    if t == 0 or not steps.any():
        return mx.zeros(x.shape, dtype=x.dtype), state
    f32 = mx.float32
    xs = x.astype(f32)
    group = h // g
    bs = mx.repeat(B.astype(f32), group, axis=1) if group > 1 else B.astype(f32)  # [T, H, N]
    cs = mx.repeat(C.astype(f32), group, axis=1) if group > 1 else C.astype(f32)
    ys = []
    for i in range(steps.steps):
        x_i, dt_i = steps.at(xs, i), steps.at(dt, i)  # [S, H, P], [S, H]
        b_i, c_i = steps.at(bs, i), steps.at(cs, i)  # [S, H, N]
        decay = mx.exp(dt_i * A[None, :])[:, :, None, None]
        updated = decay * state + (dt_i[:, :, None] * x_i)[:, :, :, None] * b_i[:, :, None, :]
        ys.append((updated * c_i[:, :, None, :]).sum(axis=-1) + D[None, :, None] * x_i)
        state = steps.keep(i, updated, state)
    return steps.packed(ys).astype(x.dtype), state
