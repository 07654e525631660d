"""A head's chained draft steps through one `mx.compile`d function (`HeadDrafter.propose` on a
device where the target's decode steps compile, `compiled.enabled`).

After its first pass a head drafts one token at a time: draft j + 1 comes from the head at the
next position fed draft j and the head's own output before it. Every chained step of a drafting
row has one query row, so the whole chain, drafts 2..k of each row, is one trace: the rows'
first positions and block tables are inputs (each step's slots are read from the tables on the
device, so the positions may be the device's: a proposal queued behind the step that verified
its tokens, `HeadDrafter.queue`), the drafts are fed from step to step on the device, and the
head's pool arrays go in and come back updated, as in the target's compiled steps
(`runner/compiled.py`, whose `bucket` pads the rows and the tables' columns and whose `NULL_SLOT`
padding rows write). A trace is made per chain length and padded shape. It takes the rows that
draft the same number of tokens (the case unless a request nears `max_model_len`); the eager
chain runs the others, and every chain once tracing failed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.runner.compiled import bucket, padded_table
from vllm_metal.backends.mlx.runner.forward import layer_cache, slots_at
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_metal.backends.mlx.runner.spec_decode.head import HeadDrafter

logger = init_logger(__name__)


class CompiledChain:
    """The compiled chained draft steps of one head drafter (`drafts`)."""

    def __init__(self, drafter: HeadDrafter):
        self.drafter = drafter
        self._traces: dict[int, object] = {}  # chain length -> its compiled function
        self.steps = 0  # chains run compiled (tests read it)
        # Traces made (a chain length or padded shape met for the first time): a chain that
        # traces also builds its kernels, which costs many chains' time, once.
        self.traces = 0
        # Why tracing the chain failed (every chain then runs eagerly), or None.
        self.failed: str | None = None

    def takes(self, caps: np.ndarray) -> bool:
        """Whether the drafting rows' chains (`caps`: each row's drafts, the first included)
        run compiled: every row drafts as many tokens, two or more."""
        return self.failed is None and caps.size > 0 and caps.min() == caps.max() and caps[0] > 1

    def drafts(
        self,
        tokens: mx.array,
        fed: mx.array,
        positions: np.ndarray | mx.array,
        tables: Sequence[np.ndarray],
        block_sizes: Sequence[int],
        num_drafts: int,
        last: int | None = None,
    ) -> mx.array | None:
        """Drafts 2..`num_drafts` of each row (`[rows, num_drafts - 1]`, lazy), the head's K/V
        of each step written into its pool: the rows' first drafts `tokens` and the head's
        output before them `fed`, drafted at `positions` (the chain's first step is at
        `positions + 1`; on the host, or on the device with `last`, no row's position above it),
        with the rows' block tables. None, with `failed` set and the pool untouched, where the
        chain cannot be traced."""
        drafter = self.drafter
        pool = drafter.pool
        assert pool is not None, "the drafter's pool is not allocated"
        num = int(positions.shape[0])
        rows = bucket(num)
        steps = num_drafts - 1
        if isinstance(positions, np.ndarray):
            last = int(positions.max())
            positions = mx.array(positions.astype(np.int32))
        assert last is not None, "device positions need their bound"
        longest = last + steps + 1  # the tokens the chain's last step attends over
        padded_tables = [
            padded_table(table, rows, longest, size) for table, size in zip(tables, block_sizes)
        ]
        pad = rows - num
        start = positions.astype(mx.int32) + 1
        if pad:
            start = mx.concatenate([start, mx.zeros((pad,), dtype=mx.int32)])
            tokens = mx.concatenate([tokens, mx.zeros((pad,), dtype=tokens.dtype)])
            fed = mx.concatenate([fed, mx.zeros((pad, *fed.shape[1:]), dtype=fed.dtype)])
        real = mx.array(np.arange(rows) < num)
        key = (steps, tuple(block_sizes))
        forward = self._traces.get(key)
        if forward is None:
            forward = self._traces[key] = mx.compile(
                lambda *args: self._trace(steps, tuple(block_sizes), *args)
            )
        try:
            drafts, keys, values = forward(
                tokens, fed, start, real, padded_tables, pool.keys, pool.values
            )
        except (ValueError, RuntimeError, TypeError, IndexError, AttributeError) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("A head's chained drafts stay eager: tracing failed (%s)", self.failed)
            return None
        pool.keys[:], pool.values[:] = keys, values
        self.steps += 1
        return drafts[:num]

    def _trace(self, steps, block_sizes, tokens, fed, start, real, tables, keys, values):
        self.traces += 1  # the Python function runs only when MLX traces
        drafter = self.drafter
        pool = drafter.pool.over(keys, values)
        rows = tokens.shape[0]
        cu_seqlens_q = mx.arange(rows + 1, dtype=mx.int32)
        drafts = []
        for j in range(1, steps + 1):
            positions = start + (j - 1)
            groups = [
                GroupTables(table, slots_at(table, size, positions, real))
                for table, size in zip(tables, block_sizes)
            ]
            meta = StepMetadata(positions, positions + 1, cu_seqlens_q, groups, query_rows=1)
            caches = [layer_cache(pool, i, kind, meta, {}) for i, kind in enumerate(drafter.kinds)]
            out, fed = drafter._pass(tokens[:, None], fed, caches, j)
            tokens = drafter._draft_tokens(out).astype(mx.int32)
            drafts.append(tokens)
        return mx.stack(drafts, axis=1), pool.keys, pool.values
