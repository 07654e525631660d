"""causal_conv1d: the depthwise short convolution in front of Gated DeltaNet / Mamba mixers, over
a packed varlen batch with a carried window per sequence.

Defined (docstring) and validated here once; implemented by reference.py (and natively where the
extension provides it).
"""

from __future__ import annotations

import mlx.core as mx

from vllm_metal.ops import _backend
from vllm_metal.ops import _validate as v
from vllm_metal.ops.short_conv import reference


def causal_conv1d(
    x: mx.array,
    weight: mx.array,
    conv_state: mx.array,
    cu_seqlens: mx.array,
    bias: mx.array | None = None,
    silu: bool = True,
    max_query_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    """SiLU of a causal depthwise convolution of each sequence, continued from its window (the
    sums themselves with ``silu=False``, LFM2's gated short convolution).

    ``x`` ``[T, C]`` packs ``S`` sequences by ``cu_seqlens`` (``[S+1]`` int32); ``weight``
    ``[C, K]``; ``conv_state`` ``[S, K-1, C]`` holds each sequence's last ``K-1`` inputs before
    its first token, oldest first (zeros for a new sequence); ``bias`` ``[C]`` or None. With
    ``u`` a sequence's window followed by its tokens,
    ``y[t, c] = silu(bias[c] + sum_j weight[c, j] * u[t + j, c])`` (accumulated in float32).
    Returns ``y`` ``[T, C]`` in the dtype of ``x`` and the new windows
    ``[S, K-1, C]`` (the last ``K-1`` entries of each ``u``) in the dtype of ``conv_state``.
    ``max_query_len=m`` states that every sequence has exactly ``m`` rows (a decode step traced
    by ``mx.compile``, `runner/compiled.py`): the pure-MLX reference then reads nothing on the
    host (the native op never does).
    """
    check_causal_conv1d(x, weight, conv_state, cu_seqlens, bias)
    v.rows_per_sequence(max_query_len, x.shape[0], conv_state.shape[0])
    native = _backend.native()
    # The native kernels apply SiLU; without it the reference's one gather serves.
    if silu and native is not None and hasattr(native, "causal_conv1d"):
        return native.causal_conv1d(x, weight, conv_state, cu_seqlens, bias)
    return reference.causal_conv1d(x, weight, conv_state, cu_seqlens, bias, silu, max_query_len)


def check_causal_conv1d(
    x: object, weight: object, conv_state: object, cu: object, bias: object = None
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    _, c = v.shape("x", x, 2, "[num_tokens, channels]")
    wc, width = v.shape("weight", weight, 2, "[channels, kernel_size]")
    if wc != c or width < 2:
        v.fail(f"weight must have shape [{c}, kernel_size >= 2], got {tuple(weight.shape)}")
    s, keep, sc = v.shape("conv_state", conv_state, 3, "[num_seqs, kernel_size - 1, channels]")
    if (keep, sc) != (width - 1, c):
        v.fail(
            f"conv_state must have shape [num_seqs, {width - 1}, {c}], "
            f"got {tuple(conv_state.shape)}"
        )
    v.float_dtype("x", x)
    v.float_dtype("weight", weight)
    v.float_dtype("conv_state", conv_state)
    v.index("cu_seqlens", cu, mx.int32, s + 1, "[num_seqs + 1]")
    if bias is not None:
        if tuple(v.array("bias", bias).shape) != (c,):
            v.fail(f"bias must have shape [channels] = ({c},), got {tuple(bias.shape)}")
        v.float_dtype("bias", bias)
