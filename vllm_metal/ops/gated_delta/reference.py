"""Pure-MLX reference of gated_delta_rule (the contract: vllm_metal.ops.gated_delta).

The sequences are padded to the longest one and stepped together, one token per step, so a decode
batch is a single step; rows past a sequence's end leave its state unchanged. Reads cu_seqlens on
the host, unless `max_query_len` gives every sequence's rows (a traced step's).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops._varlen import Lockstep


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    cu_seqlens: mx.array,
    max_query_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    t, hk, _ = q.shape
    hv = v.shape[1]
    steps = Lockstep(cu_seqlens, max_query_len)
    if t == 0 or not steps.any():
        return mx.zeros(v.shape, dtype=q.dtype), state
    group = hv // hk
    f32 = mx.float32
    qs = mx.repeat(q.astype(f32), group, axis=1) if group > 1 else q.astype(f32)
    ks = mx.repeat(k.astype(f32), group, axis=1) if group > 1 else k.astype(f32)
    vs = v.astype(f32)
    ys = []
    for i in range(steps.steps):
        q_i, k_i, v_i = (steps.at(x, i) for x in (qs, ks, vs))  # [S, Hv, D*]
        g_i, beta_i = steps.at(g, i), steps.at(beta, i)
        # A per-head decay scales the whole state, a per-channel one its key columns.
        decay = g_i[:, :, None, None] if g.ndim == 2 else g_i[:, :, None, :]
        decayed = state * decay
        remembered = (decayed * k_i[:, :, None, :]).sum(axis=-1)  # [S, Hv, Dv]
        delta = (v_i - remembered) * beta_i[:, :, None]
        updated = decayed + delta[:, :, :, None] * k_i[:, :, None, :]
        ys.append((updated * q_i[:, :, None, :]).sum(axis=-1))
        state = steps.keep(i, updated, state)
    return steps.packed(ys).astype(q.dtype), state
