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


def lockstep(
    cu_seqlens: mx.array, max_query_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``rows[s, i]``, the packed row of sequence ``s``'s ``i``-th token (row 0 where it has
    none), and ``live[s, i]``, whether it has one: ``[S, longest]`` each. Reads cu_seqlens on the
    host unless ``max_query_len`` gives every sequence's rows (`offsets`)."""
    cu = offsets(cu_seqlens, max_query_len)
    lens = np.diff(cu)
    steps = np.arange(int(lens.max(initial=0)))
    live = steps[None, :] < lens[:, None]
    return np.where(live, cu[:-1, None] + steps[None, :], 0), live


def packed(per_step: list[mx.array], live: np.ndarray) -> mx.array:
    """The per-step outputs (``[S, ...]`` each) of the live rows, in packed order."""
    stacked = mx.stack(per_step, axis=1)  # [S, steps, ...]
    seq, pos = np.nonzero(live)  # row-major over (s, i): the packed order
    return stacked[mx.array(seq), mx.array(pos)]
