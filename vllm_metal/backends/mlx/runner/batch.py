"""Varlen batch packing: the persistent InputBatch plus this step's schedule as flat arrays.

Rows follow the InputBatch order (decode requests first, then prefill chunks). Each KV-cache
group has its own block table, hence its own slot mapping; positions and lengths are shared.
Everything here is numpy on the host; the runner moves the result to the device once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class PackedBatch:
    req_ids: list[str]
    num_scheduled: np.ndarray  # [S] tokens scheduled per request
    cu_seqlens_q: np.ndarray  # [S+1] int32
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    seq_lens: np.ndarray  # [S] int32 context length after this step
    block_tables: list[np.ndarray]  # per KV-cache group: [S, max_blocks] int32
    slot_mappings: list[np.ndarray]  # per KV-cache group: [T] int64
    # Rows that need logits: each request's last scheduled token, or for a request verifying
    # k drafts its last k+1 tokens ([last sampled, d1..dk]); in request order.
    logits_indices: np.ndarray  # [S + sum(num_draft_tokens)]
    discard: np.ndarray  # [S] bool: mid-prefill, the sampled token is thrown away
    num_draft_tokens: np.ndarray  # [S] drafts verified per request (all 0 without speculation)
    # Tokens the host does not know yet: a pending step's samples still on the device
    # (`step.CarriedTokens`), as (indices into token_ids, an MLX array of those tokens).
    carried: tuple[np.ndarray, Any] | None = None
    # Where a pending verifying step's tokens and the drafts after it were carried in on the
    # device (`spec_decode.ahead.CarriedDrafts`): per row, the drafts of that step it rejected
    # (an MLX `[S]` int32 array), by which its positions and context length fall short of the
    # ones here, which count every draft as accepted as the scheduler does. None: these are the
    # step's.
    shift: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def decodes_only(self) -> bool:
        """Every request scheduled its one known token and its drafts: no prefill rows."""
        return bool((self.num_scheduled - self.num_draft_tokens == 1).all())


def pack_batch(
    req_ids: Sequence[str],
    num_scheduled_tokens: Mapping[str, int],
    num_computed_tokens: np.ndarray,
    num_known_tokens: np.ndarray,
    token_ids_table: np.ndarray,
    block_tables: Sequence[np.ndarray],
    block_sizes: Sequence[int],
    num_draft_tokens: np.ndarray | None = None,
    windows: Sequence[int | None] = (),
) -> PackedBatch:
    """Pack the scheduled tokens of `req_ids` (InputBatch order) into one varlen batch.

    num_computed_tokens / num_known_tokens / token_ids_table are the InputBatch's per-row arrays
    and block_tables its per-group tables (rows aligned with req_ids). num_draft_tokens[i] of a
    request's scheduled tokens are drafts to verify (they sit in the token table after the known
    tokens); the scheduler's `-1` placeholders among them are read as token 0. `windows`: each
    group's sliding window, if any (`KVLayout.group_windows`), whose tables name the null block
    where a window has passed (`_tables_and_slots`).
    """
    num_reqs = len(req_ids)
    num_sched = np.fromiter(
        (num_scheduled_tokens[r] for r in req_ids), dtype=np.int32, count=num_reqs
    )
    cu = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_sched, out=cu[1:])
    total = int(cu[-1])

    row_of_token = np.repeat(np.arange(num_reqs, dtype=np.int32), num_sched)
    start = num_computed_tokens[:num_reqs].astype(np.int32)
    positions = start[row_of_token] + (np.arange(total, dtype=np.int32) - cu[:-1][row_of_token])
    token_ids = np.maximum(token_ids_table[row_of_token, positions], 0).astype(np.int32)
    seq_lens = start + num_sched

    tables, slots = _tables_and_slots(
        block_tables, block_sizes, row_of_token, positions, seq_lens, windows
    )

    if num_draft_tokens is None:
        num_draft_tokens = np.zeros(num_reqs, dtype=np.int32)
    num_logits = num_draft_tokens + 1
    logits_indices = np.repeat(cu[1:] - num_logits, num_logits) + ranges(num_logits)

    return PackedBatch(
        req_ids=list(req_ids),
        num_scheduled=num_sched,
        cu_seqlens_q=cu,
        token_ids=token_ids,
        positions=positions.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        slot_mappings=slots,
        logits_indices=logits_indices.astype(np.int32),
        discard=seq_lens < num_known_tokens[:num_reqs],
        num_draft_tokens=np.asarray(num_draft_tokens, dtype=np.int32),
    )


def _tables_and_slots(
    block_tables: Sequence[np.ndarray],
    block_sizes: Sequence[int],
    row_of_token: np.ndarray,
    positions: np.ndarray,
    seq_lens: np.ndarray,
    windows: Sequence[int | None] = (),
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per KV-cache group: the block table cut to the step's rows and longest context, and each
    token's slot (block id * block size + offset).

    A windowed group's table names block 0, vLLM's null block (kept zeroed), for the blocks
    wholly before the window of a request's first row in the step: vLLM frees those blocks, and
    the worker's tables keep their ids. Freed, a block may hold another group's pages, in another
    layout where the pool pads pages of two sizes (`kv.pool`); no op reads it through a masked
    position then."""
    num_reqs = len(seq_lens)
    first = np.full(num_reqs, np.iinfo(np.int32).max, dtype=np.int64)
    if any(windows):
        np.minimum.at(first, row_of_token, positions)
    tables, slots = [], []
    for g, (table, block_size) in enumerate(zip(block_tables, block_sizes)):
        max_blocks = max(1, -(-int(seq_lens.max(initial=1)) // block_size))
        group_table = np.array(table[:num_reqs, :max_blocks], dtype=np.int32)
        block_ids = group_table[row_of_token, positions // block_size].astype(np.int64)
        window = windows[g] if windows else None
        if window is not None:
            # A row at position p attends to keys p - window + 1 .. p.
            passed = (first - window + 1) // block_size  # blocks wholly before every window
            group_table[np.arange(max_blocks)[None, :] < passed[:, None]] = 0
        tables.append(group_table)
        slots.append(block_ids * block_size + (positions % block_size))
    return tables, slots


def offsets(counts: np.ndarray) -> np.ndarray:
    """Where each of runs of `counts` items laid end to end starts: 0, counts[0], ..."""
    return np.cumsum(counts) - counts


def ranges(counts: np.ndarray) -> np.ndarray:
    """[0..counts[0]), [0..counts[1]), ... concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(offsets(counts), counts)


def prefill_batch(
    num_tokens: int, block_size: int, num_groups: int, vocab_size: int
) -> PackedBatch:
    """One sequence prefilling `num_tokens` tokens from position 0 into blocks 0, 1, ...
    (profiling and warm-up)."""
    positions = np.arange(num_tokens, dtype=np.int32)
    num_blocks = -(-num_tokens // block_size)
    table = np.arange(num_blocks, dtype=np.int32)[None, :]
    return PackedBatch(
        req_ids=["dummy"],
        num_scheduled=np.array([num_tokens], dtype=np.int32),
        cu_seqlens_q=np.array([0, num_tokens], dtype=np.int32),
        token_ids=(positions % max(2, vocab_size - 1)).astype(np.int32),
        positions=positions,
        seq_lens=np.array([num_tokens], dtype=np.int32),
        block_tables=[table] * num_groups,
        slot_mappings=[positions.astype(np.int64)] * num_groups,
        logits_indices=np.array([num_tokens - 1], dtype=np.int32),
        discard=np.array([False]),
        num_draft_tokens=np.zeros(1, dtype=np.int32),
    )


def decode_batch(
    req_ids: Sequence[str],
    positions: np.ndarray,
    token_ids: np.ndarray,
    block_tables: Sequence[np.ndarray],
    block_sizes: Sequence[int],
) -> PackedBatch:
    """One token per row at `positions` (a draft model's next step); block tables have one row
    per request of `req_ids`."""
    num_reqs = len(req_ids)
    positions = positions.astype(np.int32)
    seq_lens = positions + 1
    rows = np.arange(num_reqs, dtype=np.int32)
    tables, slots = _tables_and_slots(block_tables, block_sizes, rows, positions, seq_lens)
    return PackedBatch(
        req_ids=list(req_ids),
        num_scheduled=np.ones(num_reqs, dtype=np.int32),
        cu_seqlens_q=np.arange(num_reqs + 1, dtype=np.int32),
        token_ids=np.maximum(token_ids, 0).astype(np.int32),
        positions=positions,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mappings=slots,
        logits_indices=rows,
        discard=np.zeros(num_reqs, dtype=bool),
        num_draft_tokens=np.zeros(num_reqs, dtype=np.int32),
    )
