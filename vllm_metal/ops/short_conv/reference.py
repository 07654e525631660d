"""Pure-MLX reference of causal_conv1d (the contract: vllm_metal.ops.short_conv).

Every sequence's window and tokens are laid side by side in one buffer; each output row gathers
its K inputs from it by index (computed on the host from cu_seqlens, or from its shape where
`max_query_len` gives every sequence's rows: a traced step's), so the whole packed batch is one
gather and one weighted sum, whatever the sequence lengths.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.ops._varlen import offsets


def window_indices(cu_seqlens: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Into ``concat(conv_state.reshape(S*(K-1), C), x)``: the K inputs of every token
    (``[T, K]``, oldest first) and each sequence's new window (``[S, K-1]``)."""
    keep = width - 1
    cu = np.asarray(cu_seqlens).astype(np.int64)
    num_seqs = len(cu) - 1
    base = num_seqs * keep
    # u[s] = its window (buffer rows s*keep ...) then its tokens (buffer rows base + cu[s] ...)
    lens = np.diff(cu)
    starts = np.repeat(cu[:-1], lens)
    seq = np.repeat(np.arange(num_seqs), lens)
    local = np.arange(int(cu[-1])) - starts  # token's index in its sequence
    u = local[:, None] + np.arange(width)[None, :]  # index into u of each of the K inputs

    def buffer_row(s: np.ndarray, ui: np.ndarray) -> np.ndarray:
        return np.where(ui < keep, s * keep + ui, base + cu[s] + ui - keep)

    taps = buffer_row(seq[:, None], u)
    tail = lens[:, None] + np.arange(keep)[None, :]  # the last K-1 entries of each u
    windows = buffer_row(np.arange(num_seqs)[:, None], tail)
    return taps, windows


def causal_conv1d(
    x: mx.array,
    weight: mx.array,
    conv_state: mx.array,
    cu_seqlens: mx.array,
    bias: mx.array | None = None,
    silu: bool = True,
    max_query_len: int | None = None,
) -> tuple[mx.array, mx.array]:
    num_seqs, keep, channels = conv_state.shape
    taps, windows = window_indices(offsets(cu_seqlens, max_query_len), keep + 1)
    buffer = mx.concatenate(
        [conv_state.reshape(num_seqs * keep, channels).astype(mx.float32), x.astype(mx.float32)]
    )
    y = (buffer[mx.array(taps)] * weight.astype(mx.float32).T[None]).sum(axis=1)
    if bias is not None:
        y = y + bias.astype(mx.float32)
    if silu:
        y = y * mx.sigmoid(y)
    new_state = buffer[mx.array(windows)].astype(conv_state.dtype)
    return y.astype(x.dtype), new_state
