"""The async step: a forward queued on the device, sampled when its output is needed.

Under async scheduling vLLM schedules step N+1 while step N computes. `execute_model` queues the
forward with `mx.async_eval` and keeps a `StepState`; `sample_tokens` hands vLLM a
`PendingOutput`, and the step is sampled when vLLM asks for the output or when the next step
needs its tokens, whichever comes first (exactly once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.outputs import AsyncModelRunnerOutput, KVConnectorOutput, ModelRunnerOutput

from vllm_metal.backends.mlx.runner.batch import PackedBatch

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

    from vllm_metal.kv.pool import KVPool
    from vllm_metal.kv.state_drafts import StepDrafts


@dataclass
class StepState:
    scheduler_output: SchedulerOutput
    packed: PackedBatch
    logits: mx.array  # [S + drafts, V] float32 at packed.logits_indices (being evaluated)
    prompt_logits: dict[str, mx.array]  # req_id -> [n, V] rows for prompt logprobs
    # [S] tokens drawn on the device with the logits (`device_sampling.py`): the step's tokens
    # when nothing reads its logits but their argmax, temperature, top-k and top-p
    # (`sample.tokens_on_device`), so the logits never reach the host. None: the host samples.
    device_tokens: mx.array | None = None
    started: float = 0.0  # perf_counter() when execute_model began
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


class PendingOutput(AsyncModelRunnerOutput):
    def __init__(self, finish: Callable[[StepState], ModelRunnerOutput], step: StepState):
        self._finish = finish
        self._step = step

    def get_output(self) -> ModelRunnerOutput:
        return self._finish(self._step)


class StepPipeline:
    """At most one executed step waiting for `sample_tokens`, and one sampled lazily."""

    def __init__(self, finish: Callable[[StepState], ModelRunnerOutput], async_scheduling: bool):
        self._finish_fn = finish
        self.async_scheduling = async_scheduling
        self.executed: StepState | None = None  # waiting for sample_tokens
        self.pending: StepState | None = None  # handed out, not yet sampled

    def finish(self, step: StepState) -> ModelRunnerOutput:
        """Sample a step and record its tokens, once; later calls return the same output."""
        if step.output is None:
            if self.pending is step:
                self.pending = None
            step.output = self._finish_fn(step)
        return step.output

    def drain(self) -> None:
        """Sample the pending step: its tokens are inputs of the next one."""
        if self.pending is not None:
            self.finish(self.pending)

    def hand_out(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        step, self.executed = self.executed, None
        if step is None:
            return None
        step.grammar_output = grammar_output
        if self.async_scheduling:
            self.pending = step
            return PendingOutput(self.finish, step)
        return self.finish(step)
