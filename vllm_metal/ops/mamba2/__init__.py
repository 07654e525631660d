"""mamba2_scan: the Mamba-2 selective state-space recurrence over a packed varlen batch (the
state-space layers of Granite 4.0-H, Nemotron-H and other Mamba-2 hybrids).

Defined (docstring) and validated here once; implemented by reference.py (and natively where the
extension provides it).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _backend
from vllm_metal.ops import _validate as v
from vllm_metal.ops.mamba2 import reference


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
    """Runs the Mamba-2 recurrence over every sequence of a packed batch.

    ``x`` ``[T, H, P]`` (a float dtype) holds the packed tokens of ``S`` sequences, sequence
    ``s`` owning rows ``cu_seqlens[s] .. cu_seqlens[s+1]`` (``[S+1]`` int32). ``dt`` ``[T, H]``
    float32 is each token's time step (already through softplus and clipping), ``A`` and ``D``
    ``[H]`` float32 the per-head decay rate (negative) and skip weight, ``B`` and ``C``
    ``[T, G, N]`` (dtype of ``x``) the input and output projections of the state, head ``h``
    reading group ``h // (H // G)``; ``state`` ``[S, H, P, N]`` float32 is each sequence's
    state before its first token. Per token and head, in float32::

        S = exp(dt * A) * S + dt * x B^T;  y = S C + D * x

    Returns ``y`` ``[T, H, P]`` in the dtype of ``x`` and the states after each sequence's last
    token ``[S, H, P, N]`` float32 (a sequence with no tokens keeps its state).
    ``max_query_len=m`` states that every sequence has exactly ``m`` rows (a decode step traced
    by ``mx.compile``, `runner/compiled.py`): the pure-MLX reference then reads nothing on the
    host (the native op never does).
    """
    check_mamba2_scan(x, dt, A, B, C, D, state, cu_seqlens)
    v.rows_per_sequence(max_query_len, x.shape[0], state.shape[0])
    native = _backend.native()
    if native is not None and hasattr(native, "mamba2_scan"):
        return native.mamba2_scan(x, dt, A, B, C, D, state, cu_seqlens)
    return reference.mamba2_scan(x, dt, A, B, C, D, state, cu_seqlens, max_query_len)


def check_mamba2_scan(
    x: object,
    dt: object,
    A: object,
    B: object,
    C: object,
    D: object,
    state: object,
    cu: object,
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    t, h, p = v.shape("x", x, 3, "[num_tokens, num_heads, head_dim]")
    v.float_dtype("x", x)
    if tuple(v.shape("dt", dt, 2, "[num_tokens, num_heads]")) != (t, h):
        v.fail(f"dt must have shape [num_tokens, num_heads] = {(t, h)}, got {tuple(dt.shape)}")
    for name, a in (("A", A), ("D", D)):
        if tuple(v.shape(name, a, 1, "[num_heads]")) != (h,):
            v.fail(f"{name} must have shape [num_heads] = ({h},), got {tuple(a.shape)}")
    for name, a in (("dt", dt), ("A", A), ("D", D)):
        if a.dtype != mx.float32:
            v.fail(f"{name} must be float32, got {v.dtype_name(a.dtype)}")
    tb, g, n = v.shape("B", B, 3, "[num_tokens, num_groups, state_size]")
    if tb != t or g <= 0 or h % g:
        v.fail(f"B must have shape [{t}, num_groups dividing {h}, state_size], got {(tb, g, n)}")
    if tuple(v.array("C", C).shape) != (t, g, n):
        v.fail(f"C shape {tuple(C.shape)} differs from B shape {(t, g, n)}")
    v.same_dtype("B", B, "x", x)
    v.same_dtype("C", C, "x", x)
    s = v.shape("state", state, 4, "[num_seqs, num_heads, head_dim, state_size]")[0]
    if tuple(state.shape[1:]) != (h, p, n):
        v.fail(f"state must have shape [num_seqs, {h}, {p}, {n}], got {tuple(state.shape)}")
    if state.dtype != mx.float32:
        v.fail(f"state must be float32, got {v.dtype_name(state.dtype)}")
    v.index("cu_seqlens", cu, mx.int32, s + 1, "[num_seqs + 1]")
