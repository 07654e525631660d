"""A drafter whose head runs after the target over each request's positions and keeps paged K/V
of its own: the target's multi-token-prediction head (`mtp.py`) and an EAGLE-3 head
(`eagle3.py`).

The head at position p reads what the target computed at p (its final hidden state, or an
EAGLE-3 head's aux states) and the token at p + 1; its attention layers write K/V at p's slot,
so before a request drafts the head must have run over every position of its sequence. After a
step the positions whose next token is known (`new_positions`) are run through the head, and
for a request that drafts, the head's output at the last of them gives draft 1; draft j + 1
comes from the head at the next position fed draft j and the head's own output before it. What
the head writes at draft positions is overwritten by the next pass, which starts at the first
position not verified.

A request that does not draft after a step (the back-off paused it, or the engine measured
plain steps faster) leaves its new positions for later: what the target computed there is kept
(`_Deferred`), and the head runs over them with the request's next positions when the request
drafts again, when another request's head pass runs anyway, or when a deferred position would
complete a KV block (prefix caching may hand a complete block to another request, whose drafts
then read the head's K/V in it) or make `MAX_DEFERRED` of them. A step in which nobody drafts
and no block completes costs the head nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch, decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches, step_token_ids
from vllm_metal.backends.mlx.runner.spec_decode import ahead
from vllm_metal.backends.mlx.runner.spec_decode.chain import CompiledChain
from vllm_metal.backends.mlx.runner.spec_decode.drafter import (
    HeadWeights,
    PagedDrafter,
    block_tables,
    sampled_counts,
)

if TYPE_CHECKING:
    from vllm.config import CacheConfig

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState

# The most positions of one request whose head pass waits for the request to draft again.
MAX_DEFERRED = 64


def new_positions(
    step: StepState,
    states: RequestStates,
    num_sampled: np.ndarray,
    unrecorded: int | np.ndarray = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of the batch: the first position the target computed this step, and how many
    positions from there it computed and kept (accepted drafts included) whose next token is
    known, after the row sampled `num_sampled[i]` tokens (`unrecorded` of them not yet in the
    batch). The last of them, where the count is positive, is the position a draft chain starts
    from: its next token is the one just sampled."""
    batch = states.input_batch
    packed = step.packed
    n = batch.num_reqs
    start = packed.seq_lens - packed.num_scheduled
    kept = packed.num_scheduled - packed.num_draft_tokens + np.maximum(num_sampled - 1, 0)
    known = batch.num_tokens_no_spec[:n].astype(np.int32) + unrecorded
    return start, np.minimum(kept, known - 1 - start)


@dataclass
class _Deferred:
    """A request's positions start, start + 1, ... the head has not run over yet, with what the
    target computed at each: `pieces`, in order, each (array, first row, rows)."""

    start: int
    pieces: list[tuple[mx.array, int, int]] = field(default_factory=list)
    count: int = 0

    @property
    def end(self) -> int:
        return self.start + self.count

    def inputs(self) -> list[mx.array]:
        return [array[at : at + n] for array, at, n in self.pieces]


class HeadDrafter(HeadWeights, PagedDrafter):
    """`propose` for a head with paged K/V of its own. A subclass loads `head` and says what the
    head reads from the step (`_step_inputs`) and how it runs (`_first`, `_pass`,
    `_draft_tokens`)."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: mx.Dtype,
        cache_config: CacheConfig | None = None,
        compile_chain: bool = False,
    ):
        super().__init__(num_kv_heads, head_dim, kv_dtype, cache_config)
        self._deferred: dict[str, _Deferred] = {}
        # The chained draft steps through one compiled function (`chain.py`) where the target's
        # decode steps compile too; None: eager.
        self.chain = CompiledChain(self) if compile_chain else None
        # Proposals queued behind their step (`ahead.py`), and those dropped when the step's
        # output was not what the head was fed (tests read them).
        self.queued = self.dropped = 0

    def discard(self, tags: tuple[str, ...]) -> None:
        super().discard(tags)
        self._deferred.clear()
        if self.chain is not None:  # its traces hold the head's weights as constants
            self.chain = CompiledChain(self)

    def reset(self, req_id: str) -> None:
        self._deferred.pop(req_id, None)

    # ------------------------------------------------------------ what a head does

    def _step_inputs(self, step: StepState) -> mx.array:
        """What the head reads from the step at each packed token (`[T, width]`)."""
        raise NotImplementedError

    def _first(self, packed: PackedBatch, inputs: mx.array) -> tuple[mx.array, mx.array]:
        """The head over `packed` (tokens at p + 1, positions p) with `_step_inputs`' rows of its
        tokens: (the output the draft is read from, the state a chained step is fed)."""
        raise NotImplementedError

    def _pass(
        self, token_ids: mx.array, hidden: mx.array, caches: list, j: int
    ) -> tuple[mx.array, mx.array]:
        """Draft step `j` (0: the first pass) over tokens `[T, 1]` fed `hidden`, each layer
        writing through its view in `caches`: (the output the draft is read from, the state the
        next step is fed). Traced as well as eager (`chain.py`): it reads nothing on the host."""
        raise NotImplementedError

    def _draft_tokens(self, out: mx.array) -> mx.array:
        """The target tokens drafted from the head's outputs (`[rows]`)."""
        raise NotImplementedError

    def _run(self, packed: PackedBatch, hidden: mx.array, j: int) -> tuple[mx.array, mx.array]:
        """`_pass` over `packed` (tokens at p + 1, positions p), eagerly."""
        caches = layer_caches(self.pool, packed, self.kinds)
        return self._pass(step_token_ids(packed)[:, None], hidden, caches, j)

    # ------------------------------------------------------------ drafting

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.head is not None and self.pool is not None, "the drafter's head is not ready"
        if step.queued is not None:
            queued = step.queued.take(step, sampled)
            if queued is not None:
                return [d[:c] for d, c in zip(queued, caps.tolist())]
            self.dropped += 1
        batch = states.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        drafts: list[list[int]] = [[] for _ in range(n)]
        start, count = new_positions(step, states, sampled_counts(sampled))
        rows = np.nonzero(count > 0)[0]
        waits = np.array(
            [caps[r] <= 0 and self._may_wait(req_ids[r], start[r], count[r], states) for r in rows],
            dtype=bool,
        )
        if waits.all():  # a row that waits does not draft
            self._defer(step, rows, [req_ids[r] for r in rows], start[rows], count[rows])
            return drafts
        # The head runs: every request's deferred positions join the pass.
        tables = block_tables(states, len(step.packed.block_tables))
        first, inputs = self._catch_up(step, states, tables, rows, start, count)
        out, fed = self._first(first, inputs)
        drafting = np.nonzero(caps[rows] > 0)[0]
        if drafting.size == 0:
            # Queued, not waited for: no draft is read now, and the next step's reads of the
            # head's K/V come after these writes in MLX's graph.
            mx.async_eval(*self.pool.arrays())
            return drafts

        at_last = mx.array((first.cu_seqlens_q[1:][drafting] - 1).astype(np.int32))
        rows = rows[drafting]
        out, fed = out[at_last], fed[at_last]
        positions = start[rows] + count[rows] - 1
        tokens = self._draft_tokens(out)
        drawn = [(rows, tokens)]  # each draft step's rows and drafts, read once at the end
        compiled = None
        if self.chain is not None and self.chain.takes(caps[rows]):
            compiled = self.chain.drafts(
                tokens,
                fed,
                positions,
                [t[rows] for t in tables],
                states.block_sizes,
                int(caps[rows[0]]),
            )
        if compiled is not None:
            drawn += [(rows, compiled[:, j]) for j in range(compiled.shape[1])]
            mx.eval(tokens, compiled, *self.pool.arrays())
            return self._read(drafts, drawn)
        for j in range(1, int(caps[rows].max())):
            keep = caps[rows] > j
            if not keep.any():
                break
            kept = mx.array(np.nonzero(keep)[0].astype(np.int32))
            rows, positions = rows[keep], positions[keep] + 1
            chained = decode_batch(
                [req_ids[r] for r in rows],
                positions,
                np.zeros(rows.size, dtype=np.int32),
                [t[rows] for t in tables],
                states.block_sizes,
            )
            # Draft j - 1 is fed on the device (`PackedBatch.carried`): no wait between steps.
            chained.carried = (np.arange(rows.size, dtype=np.int32), tokens[kept])
            out, fed = self._run(chained, fed[kept], j)
            tokens = self._draft_tokens(out)
            drawn.append((rows, tokens))
        mx.eval(*(t for _, t in drawn), fed, *self.pool.arrays())
        return self._read(drafts, drawn)

    @staticmethod
    def _read(drafts: list[list[int]], drawn: list[tuple[np.ndarray, mx.array]]) -> list[list[int]]:
        """`drafts` with each draft step's tokens (`drawn`: its rows and their drafts, evaluated)
        appended to their rows' lists."""
        for step_rows, step_tokens in drawn:
            for r, token in zip(step_rows, np.array(step_tokens).tolist()):
                drafts[r].append(int(token))
        return drafts

    def may_queue(self, step: StepState, states: RequestStates) -> bool:
        return ahead.possible(self, step, states)

    def queue(self, step: StepState, states: RequestStates, caps: np.ndarray) -> None:
        assert self.chain is not None
        step.queued = ahead.queue(self, step, states, caps)
        self.queued += step.queued is not None

    def keeps_up(self, step: StepState, states: RequestStates, num_sampled: np.ndarray) -> bool:
        """The step's new positions deferred, where every request may wait (the head's pass
        reads the tokens that follow them)."""
        start, count = new_positions(step, states, num_sampled, unrecorded=num_sampled)
        rows = np.nonzero(count > 0)[0]
        req_ids = states.input_batch.req_ids
        if not all(self._may_wait(req_ids[r], start[r], count[r], states) for r in rows):
            return False
        self._defer(step, rows, [req_ids[r] for r in rows], start[rows], count[rows])
        return True

    def _may_wait(self, req_id: str, start: int, count: int, states: RequestStates) -> bool:
        """Whether a request that does not draft may leave its new positions for later."""
        deferred = self._kept_before(req_id, start)
        first = start if deferred is None else deferred.start
        last = start + count - 1
        if last - first + 1 > MAX_DEFERRED:
            return False
        # A block whose last position is among them is complete.
        return not any((last + 1) // size > first // size for size in states.block_sizes)

    def _kept_before(self, req_id: str, start: int) -> _Deferred | None:
        """The request's deferred positions where they end just before `start` (else the
        positions computed since were not theirs to follow, and they are dropped when replaced)."""
        deferred = self._deferred.get(req_id)
        return deferred if deferred is not None and deferred.end == start else None

    def _defer(
        self,
        step: StepState,
        rows: np.ndarray,
        req_ids: list[str],
        start: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """Keep what the target computed at the new positions of `rows` (of the batch and of
        the step alike) for the requests' next head pass."""
        if rows.size == 0:
            return
        packed = step.packed
        offsets = packed.cu_seqlens_q[rows]
        kept = self._step_inputs(step)
        if rows.size == packed.num_tokens and (count == 1).all():  # a decode step
            at = offsets
        else:  # a copy of the rows kept, so the step's other rows are not held
            gather = np.concatenate([o + np.arange(c) for o, c in zip(offsets, count)])
            kept = kept[mx.array(gather.astype(np.int32))]
            mx.async_eval(kept)
            at = np.concatenate([[0], np.cumsum(count)[:-1]])
        for req_id, s, c, a in zip(req_ids, start.tolist(), count.tolist(), at.tolist()):
            deferred = self._kept_before(req_id, s)
            if deferred is None:
                deferred = self._deferred[req_id] = _Deferred(s)
            deferred.pieces.append((kept, a, c))
            deferred.count += c

    def _catch_up(
        self,
        step: StepState,
        states: RequestStates,
        tables: list[np.ndarray],
        rows: np.ndarray,
        start: np.ndarray,
        count: np.ndarray,
    ) -> tuple[PackedBatch, mx.array]:
        """The head's first pass of a step: each row's new positions (`rows` of the batch),
        after its deferred ones, with what the target computed at each."""
        batch = states.input_batch
        ids = [batch.req_ids[r] for r in rows]
        step_inputs = self._step_inputs(step)
        offsets = step.packed.cu_seqlens_q[rows]
        new = count[rows]
        first_pos, num = start[rows].copy(), new.copy()
        pieces: list[mx.array] = []
        for i, req_id in enumerate(ids):
            deferred = self._kept_before(req_id, int(first_pos[i]))
            self._deferred.pop(req_id, None)
            if deferred is not None:
                first_pos[i], num[i] = deferred.start, num[i] + deferred.count
                pieces.extend(deferred.inputs())
            pieces.append(step_inputs[int(offsets[i]) : int(offsets[i] + new[i])])
        # Column p of the shifted table holds the token at p + 1: the head's input at p.
        packed = pack_batch(
            ids,
            dict(zip(ids, num.tolist())),
            first_pos,
            first_pos + num,
            batch.token_ids_cpu[rows, 1:],
            [t[rows] for t in tables],
            states.block_sizes,
        )
        return packed, mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]
