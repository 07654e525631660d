"""Varlen batch packing: turn the persistent InputBatch plus this step's schedule into flat arrays.

Rows follow the InputBatch order, which the runner keeps as decode requests first and prefill
chunks after. Everything here is numpy on the host; the runner moves the result to MLX once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PackedBatch:
    req_ids: list[str]
    num_scheduled: np.ndarray  # [S] tokens scheduled per request
    cu_seqlens_q: np.ndarray  # [S+1] int32
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [S] int32 context length after this step
    block_tables: np.ndarray  # [S, max_blocks] int32
    logits_indices: np.ndarray  # [S] row of each request's last scheduled token
    discard: np.ndarray  # [S] bool: mid-prefill, the sampled token is thrown away

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def pack_batch(
    req_ids: list[str],
    num_scheduled_tokens: dict[str, int],
    num_computed_tokens: np.ndarray,
    num_known_tokens: np.ndarray,
    token_ids_table: np.ndarray,
    block_table: np.ndarray,
    block_size: int,
) -> PackedBatch:
    """Pack the scheduled tokens of `req_ids` (InputBatch order) into one varlen batch.

    num_computed_tokens / num_known_tokens / token_ids_table / block_table are the InputBatch's
    per-row arrays (rows aligned with req_ids).
    """
    num_reqs = len(req_ids)
    num_sched = np.fromiter((num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=num_reqs)
    cu = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_sched, out=cu[1:])
    total = int(cu[-1])

    row_of_token = np.repeat(np.arange(num_reqs, dtype=np.int32), num_sched)
    start = num_computed_tokens[:num_reqs].astype(np.int32)
    positions = start[row_of_token] + (np.arange(total, dtype=np.int32) - cu[:-1][row_of_token])
    token_ids = token_ids_table[row_of_token, positions].astype(np.int32)

    seq_lens = start + num_sched
    max_blocks = max(1, int(-(-int(seq_lens.max(initial=1)) // block_size)))
    tables = np.ascontiguousarray(block_table[:num_reqs, :max_blocks], dtype=np.int32)
    block_ids = tables[row_of_token, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + (positions % block_size)

    discard = seq_lens < num_known_tokens[:num_reqs]
    return PackedBatch(
        req_ids=list(req_ids),
        num_scheduled=num_sched,
        cu_seqlens_q=cu,
        token_ids=token_ids,
        positions=positions.astype(np.int32),
        slot_mapping=slot_mapping,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        logits_indices=(cu[1:] - 1).astype(np.int32),
        discard=discard,
    )
