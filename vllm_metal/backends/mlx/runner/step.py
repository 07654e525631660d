"""The async step: a forward queued on the device, sampled when its output is needed.

Under async scheduling vLLM schedules step N+1 while step N computes. `execute_model` queues the
forward with `mx.async_eval` and keeps a `StepState`; `sample_tokens` hands vLLM a
`PendingOutput`, and the step is sampled when vLLM asks for the output or when the next step
needs its tokens on the host, whichever comes first (exactly once, in step order).

A step whose tokens were drawn on the device need not be sampled before the next one: step
N+1 takes them as a device array (`CarriedTokens`), so its graph is built and queued while step
N still runs, and N's tokens reach the host only when vLLM asks for N's output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, ModelRunnerOutput

from vllm_metal.backends.mlx.runner.batch import PackedBatch

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

    from vllm_metal.backends.mlx.runner.seeded import KeyedNoise
    from vllm_metal.backends.mlx.runner.spec_decode.ahead import CarriedDrafts, QueuedDrafts
    from vllm_metal.kv.pool import KVPool
    from vllm_metal.kv.state_drafts import StepDrafts


@dataclass(eq=False)
class StepState:
    scheduler_output: SchedulerOutput
    packed: PackedBatch
    logits: mx.array  # [S + drafts, V] float32 at packed.logits_indices (being evaluated)
    prompt_logits: dict[str, mx.array]  # req_id -> [n, V] rows for prompt logprobs
    # [S] tokens drawn on the device with the logits (`device_sampling.py`, after each row's
    # rules): the step's tokens unless `sample.host_route` sends the step to the host, so the
    # logits never reach the host. None: the host samples.
    device_tokens: mx.array | None = None
    # (ids, logprobs, ranks) of `device_tokens` as vLLM's sampler gives them, drawn with them
    # where the step asks for logprobs (`device_sampling.step_logprobs`), and the `[S, V]`
    # values they were taken from (`device_sampling.logprob_values`).
    device_logprobs: tuple[mx.array, mx.array, mx.array] | None = None
    logprob_values: mx.array | None = None
    # The seeded rows' noise `device_tokens` (or `verdicts`) were drawn with
    # (`seeded.keyed_noise`), for a grammar's rows drawn again; None where the step has no
    # seeded rows, or its drafts are verified on the host or taken from the device.
    keyed: KeyedNoise | None = None
    # ([S + drafts] tokens, [S + drafts] accepts): each logits row's verdict on the draft it
    # scores, from which a step verifying drafts on the device takes its tokens
    # (`spec_decode.verify.device_verdicts`); None: the host verifies them.
    verdicts: tuple[mx.array, mx.array] | None = None
    started: float = 0.0  # perf_counter() when execute_model began
    traced: bool = False  # its compiled forward traced a new shape (`Forward.traced`)
    grammar_output: GrammarOutput | None = None
    output: ModelRunnerOutput | None = None
    kv_connector_output: KVConnectorOutput | None = None  # the step's KV transfers
    drafts: StepDrafts | None = None  # a hybrid's states that wait for the verified drafts
    # The final hidden states of every packed token, `[T, 1, hidden]`, kept for a drafter that
    # reads them (an MTP head, `spec_decode/mtp.py`); None otherwise.
    hidden: mx.array | None = None
    # The target's KV pool the step wrote, kept for a drafter that attends over the target's K/V
    # (an MTP assistant, `spec_decode/assistant.py`); None otherwise.
    kv_pool: KVPool | None = None
    # Set when a later step took `device_tokens` on the device (`StepPipeline.drain`): the
    # step's output is those tokens, whatever the batch holds by the time it is sampled.
    carried: bool = False
    # The target's aux hidden states of every packed token, `[T, 1, n * hidden]`, kept for an
    # EAGLE-3 head (`spec_decode/eagle3.py`); None otherwise.
    aux_hidden: mx.array | None = None
    # Under speculative decoding, the drafts each row may propose after the step where they
    # were decided before its tokens reached the host (`SpecDecoder.plan_ahead`).
    spec_caps: np.ndarray | None = None
    # A head's drafts for the next step, queued on the device behind this one
    # (`spec_decode/ahead.py`); None: proposed once the step's tokens are on the host.
    queued: QueuedDrafts | None = None
    # Set with `carried` where the next step took the step's tokens and those drafts on the
    # device (`ahead.CarriedDrafts`), to be settled when the step's tokens reach the host.
    carried_drafts: CarriedDrafts | None = None


@dataclass
class CarriedTokens:
    """A pending step's tokens drawn on the device, as inputs of the next step's forward."""

    req_ids: list[str]  # the pending step's rows
    positions: np.ndarray  # [S] the position of each row's new token (its context length)
    sampled: np.ndarray  # [S] bool: the row drew a token (not mid-prefill)
    tokens: mx.array  # [S] the rows' tokens (being evaluated)

    @classmethod
    def of(cls, step: StepState) -> CarriedTokens:
        packed = step.packed
        assert step.device_tokens is not None
        return cls(packed.req_ids, packed.seq_lens, ~packed.discard, step.device_tokens)

    def into(self, packed: PackedBatch) -> PackedBatch:
        """`packed` with the carried tokens it reads (a request's token at the position its
        previous row sampled) recorded as `packed.carried`: (token indices, their tokens)."""
        row_of = {req_id: i for i, req_id in enumerate(self.req_ids)}
        prev = np.fromiter(
            (row_of.get(r, -1) for r in packed.req_ids), np.int64, len(packed.req_ids)
        )
        starts = packed.cu_seqlens_q[:-1]
        found = prev >= 0
        found[found] &= self.sampled[prev[found]]
        rows = np.nonzero(found)[0]
        offset = self.positions[prev[rows]] - packed.positions[starts[rows]]
        inside = (offset >= 0) & (offset < packed.num_scheduled[rows])
        rows, offset = rows[inside], offset[inside]
        if rows.size == 0:
            return packed
        index = (starts[rows] + offset).astype(np.int32)
        packed.carried = (index, self.tokens[mx.array(prev[rows].astype(np.int32))])
        return packed


def unrecorded_outputs(packed: PackedBatch) -> tuple[np.ndarray, mx.array] | None:
    """The outputs of a step's sampling rows that the host's token lists lack: the tokens a
    pending step drew, carried into this one (`packed.carried`), as (the rows reading them, the
    tokens); None where none were carried. Only a step without drafts, whose rows are its
    requests, counts them (a verifying step is carried only where no rule counts outputs)."""
    if packed.carried is None or packed.num_draft_tokens.any():
        return None
    index, tokens = packed.carried
    return np.searchsorted(packed.cu_seqlens_q, index, side="right") - 1, tokens


class PendingOutput(AsyncModelRunnerOutput):
    def __init__(self, finish: Callable[[StepState], ModelRunnerOutput], step: StepState):
        self._finish = finish
        self._step = step

    def get_output(self) -> ModelRunnerOutput:
        return self._finish(self._step)


class StepPipeline:
    """At most one executed step waiting for `sample_tokens`; the steps handed out and not yet
    sampled, sampled lazily and in order."""

    def __init__(self, finish: Callable[[StepState], ModelRunnerOutput], async_scheduling: bool):
        self._finish_fn = finish
        self.async_scheduling = async_scheduling
        self.executed: StepState | None = None  # waiting for sample_tokens
        self.pending: list[StepState] = []  # handed out, not yet sampled; oldest first
        self.carried_steps = 0  # steps whose tokens went into the next one on the device

    def finish(self, step: StepState) -> ModelRunnerOutput:
        """Sample a step and record its tokens, once, after every step handed out before it;
        later calls return the same output."""
        while step.output is None and self.pending:
            earlier = self.pending.pop(0)
            earlier.output = self._finish_fn(earlier)
        if step.output is None:  # never handed out (no async scheduling)
            step.output = self._finish_fn(step)
        return step.output

    def drain(self, carries: Callable[[StepState], bool]) -> StepState | None:
        """Before the next step: sample the pending steps, except the newest when `carries` it
        (its tokens drawn on the device go into the next step as they are); returns that one."""
        if not self.pending:
            return None
        newest = self.pending[-1]
        if len(self.pending) > 1:  # `carries` weighs the newest after every earlier step
            self.finish(self.pending[-2])
        if not carries(newest):
            self.finish(newest)
            return None
        newest.carried = True
        self.carried_steps += 1
        return newest

    def hand_out(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        step, self.executed = self.executed, None
        if step is None:
            return None
        step.grammar_output = grammar_output
        if self.async_scheduling:
            self.pending.append(step)
            return PendingOutput(self.finish, step)
        return self.finish(step)
