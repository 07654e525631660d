"""Packed varlen batches stepped one token at a time, all sequences together: what the pure-MLX
references of the recurrent ops (gated_delta/, mamba2/) share."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def offsets(cu_seqlens: mx.array, max_query_len: int | None = None) -> np.ndarray:
    """``cu_seqlens`` on the host: read there, or where every sequence has ``max_query_len``
    rows (a traced step's, `ops` contracts) made from its shape alone, reading nothing."""
    if max_query_len is None:
        return np.asarray(cu_seqlens).astype(np.int64)
    return np.arange(cu_seqlens.shape[0], dtype=np.int64) * max_query_len


class Lockstep:
    """The sequences of a packed batch (``[S+1]`` ``cu_seqlens``) padded to the longest and
    stepped together: step ``i`` takes every sequence's ``i``-th token. Where every sequence has
    ``max_query_len`` rows (a traced step's) a step's rows are a strided view of the packed
    ones, and every sequence takes every step; else they are gathered by index (read on the
    host), a sequence past its end taking row 0 and keeping its state (`keep`)."""

    def __init__(self, cu_seqlens: mx.array, max_query_len: int | None = None):
        cu = offsets(cu_seqlens, max_query_len)
        lens = np.diff(cu)
        self.num_seqs = len(lens)
        self.steps = int(lens.max(initial=0))
        self.uniform = max_query_len is not None
        index = np.arange(self.steps)
        self.live = index[None, :] < lens[:, None]  # [S, steps]
        self._rows = np.where(self.live, cu[:-1, None] + index[None, :], 0)

    def any(self) -> bool:
        return bool(self.live.any())

    def at(self, x: mx.array, i: int) -> mx.array:
        """Step ``i``'s rows of ``x`` (``[T, ...]`` packed): ``[S, ...]``."""
        if self.uniform:
            return x.reshape(self.num_seqs, self.steps, *x.shape[1:])[:, i]
        return x[mx.array(self._rows[:, i])]

    def keep(self, i: int, updated: mx.array, state: mx.array) -> mx.array:
        """The state after step ``i``: ``updated`` where the sequence had a token there."""
        if self.uniform:
            return updated
        return mx.where(mx.array(self.live[:, i])[:, None, None, None], updated, state)

    def packed(self, per_step: list[mx.array]) -> mx.array:
        """The per-step outputs (``[S, ...]`` each) of the live rows, in packed order."""
        stacked = mx.stack(per_step, axis=1)  # [S, steps, ...]
        if self.uniform:
            return stacked.reshape(-1, *stacked.shape[2:])
        seq, pos = np.nonzero(self.live)  # row-major over (s, i): the packed order
        return stacked[mx.array(seq), mx.array(pos)]
