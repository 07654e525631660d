"""A head's proposal queued behind the step that verifies the drafts before it.

A head drafts from the target's states at the last verified position of each request, so its
first pass waits for the step's verdicts. Where they are drawn on the device
(`verify.device_verdicts`), the pass need not wait on the host: the head runs over every row of
the step, fed at each row the token its verdict gives (the next token there, wherever the
drafts before the row were accepted), and each request's first draft is read at the row of its
last accepted draft, counted on the device; the chained steps start from there
(`chain.CompiledChain` reads their slots from the block tables on the device). The whole
proposal is queued with the step, so when the engine asks for the step's output the drafts are
ready with its tokens: one wait instead of two, and the head's graph built while the target's
forward runs.

The rows past a rejected draft are fed the wrong tokens, as the eager path's chained steps
write K/V at draft positions: the next pass starts at the first position not verified and
writes over them. The positions the chain reaches lie inside the lookahead slots vLLM reserved
with the step (`VllmConfig.num_lookahead_tokens`: the speculative tokens, for heads).

It runs where the head would draft for every row of the step as many tokens, through its compiled
chain (two or more), after a step where every request verified as many drafts on the device
and no row is seeded (drawn again by position on the host) or mid-prefill, and no request
has positions whose head pass was deferred (`head._Deferred`). When the step's output differs
from the tokens the pass was fed (a token past the vocabulary dropped, or verdicts the host
replaced), the drafts are dropped and the head proposes as before, from the host's tokens.

Queued drafts also let the next step be built before the step's tokens reach the host
(`CarriedDrafts`): its tokens, drafts and positions are taken on the device, and its host
records are settled once the tokens arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import _tables_and_slots
from vllm_metal.backends.mlx.runner.spec_decode.drafter import block_tables

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.spec_decode.head import HeadDrafter
    from vllm_metal.backends.mlx.runner.step import StepState


@dataclass
class QueuedDrafts:
    """The drafts for the step after one, queued on the device behind it."""

    accepted: mx.array  # [S] each row's leading accepted drafts, by the device's verdicts
    drafts: mx.array  # [S, num_drafts] the drafts proposed from there

    def take(self, step: StepState, sampled: list[list[int]]) -> list[list[int]] | None:
        """Each row's drafts, where the step's output is the tokens the head was fed (every
        row's verdicts up to and with its first rejected draft's); else None."""
        assert step.verdicts is not None
        accepted = np.array(self.accepted).tolist()
        chosen = np.array(step.verdicts[0])
        first_row = step.packed.cu_seqlens_q[:-1]
        for row, (start, count) in enumerate(zip(first_row.tolist(), accepted)):
            if sampled[row] != chosen[start : start + count + 1].tolist():
                return None
        return np.array(self.drafts).tolist()


def possible(drafter: HeadDrafter, step: StepState, states: RequestStates) -> bool:
    """Whether the head's proposal after `step` may be queued behind it (the module's rules),
    who drafts how many aside."""
    packed = step.packed
    drafts = packed.num_draft_tokens
    if (
        drafter.head is None
        or drafter.chain is None
        or drafter.chain.failed is not None
        or drafter.pool is None
        or step.verdicts is None
        or states.input_batch.generators
        or drafts.size == 0
        or drafts.min() != drafts.max()
        or drafts[0] == 0
        or not packed.decodes_only
    ):
        return False
    first = packed.positions[packed.cu_seqlens_q[:-1]]
    return not any(drafter._kept_before(r, int(p)) for r, p in zip(packed.req_ids, first))


def queue(
    drafter: HeadDrafter, step: StepState, states: RequestStates, caps: np.ndarray
) -> QueuedDrafts | None:
    """The head's drafts after `step` (`caps[0]` per row), queued on the device; None where
    they cannot be: the rows do not all draft as many (two or more), or the chain failed to
    trace."""
    if not drafter.chain.takes(caps):
        return None
    packed = step.packed
    assert step.verdicts is not None and drafter.pool is not None
    tokens, accepts = step.verdicts
    per_request = int(packed.num_draft_tokens[0]) + 1
    # A row's drafts are scored by its first `per_request - 1` verdicts; the last is its bonus.
    scored = accepts.reshape(-1, per_request)[:, :-1]
    accepted = mx.cumprod(scored.astype(mx.int32), axis=1).sum(axis=1)
    for req_id in packed.req_ids:
        drafter._deferred.pop(req_id, None)
    # Every row fed its verdict's token, as a pending step's tokens are carried into the next.
    fed = replace(packed, carried=(np.arange(packed.num_tokens, dtype=np.int32), tokens))
    out, hidden = drafter._first(fed, drafter._step_inputs(step))
    at = mx.array(packed.cu_seqlens_q[:-1]) + accepted
    out, hidden = out[at], hidden[at]
    first_drafts = drafter._draft_tokens(out).astype(mx.int32)
    starts = packed.positions[packed.cu_seqlens_q[:-1]]
    first = mx.array(starts.astype(np.int32))
    if packed.shift is not None:  # the step's own drafts came in on the device
        first = first - packed.shift
    num_drafts = int(caps[0])
    chained = drafter.chain.drafts(
        first_drafts,
        hidden,
        first + accepted,
        block_tables(states, len(packed.block_tables)),
        states.block_sizes,
        num_drafts,
        last=int(starts.max()) + per_request - 1,
    )
    if chained is None:
        return None
    drafts = mx.concatenate([first_drafts[:, None], chained], axis=1)
    mx.async_eval(accepted, drafts, *drafter.pool.arrays())
    return QueuedDrafts(accepted, drafts)


@dataclass
class CarriedDrafts:
    """A pending verifying step's tokens and the drafts queued behind it, as inputs of the next
    step (the one-step-ahead order of `step.CarriedTokens` for speculative decoding): each
    request's row there is its next token (the verdict at its last accepted draft's row) and
    its drafts, at the positions the scheduler gave it less the drafts it rejected
    (`PackedBatch.shift`), all on the device. Once the pending step's tokens reach the host,
    `settle` makes the next step's host records what the device used."""

    step: StepState
    tokens: mx.array  # [S, 1 + num_drafts] each row of the pending step: next token, drafts
    rejected: mx.array  # [S] int32 the drafts each row rejected
    num_drafts: int
    into_packed: PackedBatch | None = None  # the next step's, once it took them (`into`)
    into_rows: np.ndarray | None = None  # each of its rows' row in the pending step

    @classmethod
    def of(cls, step: StepState) -> CarriedDrafts:
        packed, queued = step.packed, step.queued
        assert queued is not None and step.verdicts is not None
        verdict_tokens, _ = step.verdicts
        per_request = int(packed.num_draft_tokens[0]) + 1
        last = mx.array(packed.cu_seqlens_q[:-1]) + queued.accepted
        tokens = mx.concatenate([verdict_tokens[last][:, None], queued.drafts], axis=1)
        rejected = (per_request - 1 - queued.accepted).astype(mx.int32)
        return cls(step, tokens, rejected, int(queued.drafts.shape[1]))

    @staticmethod
    def fits(step: StepState, scheduler_output: SchedulerOutput) -> bool:
        """Whether the next step (`scheduler_output`) is the pending step's requests again,
        each with its last token and as many placeholders as drafts were queued."""
        assert step.queued is not None
        num_drafts = int(step.queued.drafts.shape[1])
        scheduled = scheduler_output.num_scheduled_tokens
        placeholders = scheduler_output.scheduled_spec_decode_tokens
        return (
            not scheduler_output.scheduled_new_reqs
            and not scheduler_output.scheduled_cached_reqs.resumed_req_ids
            and set(scheduled) == set(step.packed.req_ids)
            and all(n == 1 + num_drafts for n in scheduled.values())
            and all(len(placeholders.get(r, ())) == num_drafts for r in scheduled)
        )

    def placeholders(self) -> dict[str, list[int]]:
        """What stands in for the drafts in the host's records until they are known (the
        scheduler's placeholders are then all in the step)."""
        return {r: [0] * self.num_drafts for r in self.step.packed.req_ids}

    def into(self, packed: PackedBatch) -> PackedBatch:
        """`packed` (the pending step's requests, `fits`) with every token and shift on the
        device."""
        row_of = {req_id: i for i, req_id in enumerate(self.step.packed.req_ids)}
        self.into_rows = np.array([row_of[r] for r in packed.req_ids], dtype=np.int32)
        prev = mx.array(self.into_rows)
        packed.carried = (
            np.arange(packed.num_tokens, dtype=np.int32),
            self.tokens[prev].reshape(-1),
        )
        packed.shift = self.rejected[prev]
        self.into_packed = packed
        return packed

    def settle(self, states: RequestStates, rejected: np.ndarray, drafts: list[list[int]]) -> None:
        """Once the pending step's tokens are recorded (`rejected[i]`: the drafts its row i
        rejected; `drafts[i]`: those queued behind it): the next step's requests count the
        tokens they really computed, hold their real drafts, and its packed batch the positions,
        lengths and slots its forward used."""
        packed, prev = self.into_packed, self.into_rows
        assert packed is not None and prev is not None, "settled before the next step took them"
        batch = states.input_batch
        for req_id, q in zip(packed.req_ids, prev.tolist()):
            state = states.requests.get(req_id)
            if state is not None:
                state.num_computed_tokens -= int(rejected[q])
            i = batch.req_id_to_index.get(req_id)
            if i is not None:
                batch.num_computed_tokens_cpu[i] -= int(rejected[q])
                batch.spec_token_ids[i][:] = drafts[q][: self.num_drafts]
        shift = rejected[prev]
        row_of_token = np.repeat(np.arange(len(prev)), packed.num_scheduled)
        packed.positions = (packed.positions - shift[row_of_token]).astype(np.int32)
        packed.seq_lens = (packed.seq_lens - shift).astype(np.int32)
        _, packed.slot_mappings = _tables_and_slots(
            packed.block_tables, states.block_sizes, row_of_token, packed.positions, packed.seq_lens
        )
        packed.shift = None
