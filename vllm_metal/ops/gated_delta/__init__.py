"""gated_delta_rule: the Gated DeltaNet recurrence over a packed varlen batch (Qwen3-Next's and
Qwen3.5's linear-attention layers, and Kimi Delta Attention's, whose decay is per key channel).

Defined (docstring) and validated here once; implemented by reference.py (and natively where the
extension provides it).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _backend
from vllm_metal.ops import _validate as v
from vllm_metal.ops.gated_delta import reference


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v_: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    cu_seqlens: mx.array,
    max_query_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Runs the gated delta rule over every sequence of a packed batch.

    ``q``/``k`` ``[T, Hk, Dk]`` and ``v_`` ``[T, Hv, Dv]`` (one float dtype) hold the packed
    tokens of ``S`` sequences, sequence ``s`` owning rows ``cu_seqlens[s] .. cu_seqlens[s+1]``
    (``[S+1]`` int32). ``g`` (decay factor, per head ``[T, Hv]`` or per key channel
    ``[T, Hv, Dk]``) and ``beta`` (write strength, ``[T, Hv]``) are float32; ``state``
    ``[S, Hv, Dv, Dk]`` float32 is each sequence's state before its first token. Value head ``h``
    reads query/key head ``h // (Hv // Hk)``. Per token, in float32 (a per-channel ``g`` scales
    the state's key columns)::

        S = g * S;  S += beta * (v - S k) k^T;  y = S q

    Returns ``y`` ``[T, Hv, Dv]`` in the dtype of ``q`` and the states after each sequence's
    last token ``[S, Hv, Dv, Dk]`` float32 (a sequence with no tokens keeps its state).
    ``max_query_len=m`` states that every sequence has exactly ``m`` rows (a decode step traced
    by ``mx.compile``, `runner/compiled.py`): the pure-MLX reference then reads nothing on the
    host (the native op never does).
    """
    check_gated_delta_rule(q, k, v_, g, beta, state, cu_seqlens)
    v.rows_per_sequence(max_query_len, q.shape[0], state.shape[0])
    native = _backend.native()
    # The native kernel takes a per-head decay; a per-channel one runs the reference.
    per_head = g.ndim == 2
    if per_head and native is not None and hasattr(native, "gated_delta_rule"):
        return native.gated_delta_rule(q, k, v_, g, beta, state, cu_seqlens)
    return reference.gated_delta_rule(q, k, v_, g, beta, state, cu_seqlens, max_query_len)


def check_gated_delta_rule(
    q: object, k: object, v_: object, g: object, beta: object, state: object, cu: object
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    t, hk, dk = v.shape("q", q, 3, "[num_tokens, num_k_heads, head_k_dim]")
    if tuple(v.array("k", k).shape) != (t, hk, dk):
        v.fail(f"k shape {tuple(k.shape)} differs from q shape {(t, hk, dk)}")
    tv, hv, dv = v.shape("v", v_, 3, "[num_tokens, num_v_heads, head_v_dim]")
    if tv != t:
        v.fail(f"v has {tv} tokens, q has {t}")
    if hk <= 0 or hv % hk:
        v.fail(f"num_v_heads ({hv}) must be a positive multiple of num_k_heads ({hk})")
    v.float_dtype("q", q)
    v.same_dtype("k", k, "q", q)
    v.same_dtype("v", v_, "q", q)
    g_shapes = ((t, hv), (t, hv, dk))
    if tuple(v.array("g", g).shape) not in g_shapes:
        v.fail(
            f"g must have shape [num_tokens, num_v_heads] = {g_shapes[0]} or "
            f"[num_tokens, num_v_heads, head_k_dim] = {g_shapes[1]}, got {tuple(g.shape)}"
        )
    if tuple(v.shape("beta", beta, 2, "[num_tokens, num_v_heads]")) != (t, hv):
        v.fail(f"beta must have shape [num_tokens, num_v_heads] = {(t, hv)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.dtype != mx.float32:
            v.fail(f"{name} must be float32, got {v.dtype_name(x.dtype)}")
    s = v.shape("state", state, 4, "[num_seqs, num_v_heads, head_v_dim, head_k_dim]")[0]
    if tuple(state.shape[1:]) != (hv, dv, dk):
        v.fail(f"state must have shape [num_seqs, {hv}, {dv}, {dk}], got {tuple(state.shape)}")
    if state.dtype != mx.float32:
        v.fail(f"state must be float32, got {v.dtype_name(state.dtype)}")
    v.index("cu_seqlens", cu, mx.int32, s + 1, "[num_seqs + 1]")
