"""Pure-MLX reference of gated_delta_rule (the contract: vllm_metal.ops.gated_delta).

The sequences are padded to the longest one and stepped together, one token per step, so a decode
batch is a single step; rows past a sequence's end leave its state unchanged. Reads cu_seqlens on
the host, unless `max_query_len` gives every sequence's rows (a traced step's).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops._varlen import lockstep, packed


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
    rows, live = lockstep(cu_seqlens, max_query_len)
    if t == 0 or not live.any():
        return mx.zeros(v.shape, dtype=q.dtype), state
    group = hv // hk
    f32 = mx.float32
    qs = mx.repeat(q.astype(f32), group, axis=1) if group > 1 else q.astype(f32)
    ks = mx.repeat(k.astype(f32), group, axis=1) if group > 1 else k.astype(f32)
    vs = v.astype(f32)
    ys = []
    for i in range(rows.shape[1]):
        r = mx.array(rows[:, i])
        q_i, k_i, v_i = qs[r], ks[r], vs[r]  # [S, Hv, D*]
        # A per-head decay scales the whole state, a per-channel one its key columns.
        decay = g[r][:, :, None, None] if g.ndim == 2 else g[r][:, :, None, :]
        decayed = state * decay
        remembered = (decayed * k_i[:, :, None, :]).sum(axis=-1)  # [S, Hv, Dv]
        delta = (v_i - remembered) * beta[r][:, :, None]
        updated = decayed + delta[:, :, :, None] * k_i[:, :, None, :]
        ys.append((updated * q_i[:, :, None, :]).sum(axis=-1))
        state = mx.where(mx.array(live[:, i])[:, None, None, None], updated, state)
    return packed(ys, live).astype(q.dtype), state
