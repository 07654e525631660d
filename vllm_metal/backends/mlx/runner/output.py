"""How a step ends, chosen by vLLM's `runner_type`: `Sampling` (`sample.py`: logits, queued and
sampled with vLLM's sampler) or `Pooling` (`pool/pooling.py`: hidden states through vLLM's
pooler). Both meet `OutputStage`; the model kind (`model_states/`) is chosen independently."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.config import VllmConfig
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.kv_connector import ConnectorSteps
    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.spec_decode.ahead import CarriedDrafts
    from vllm_metal.backends.mlx.runner.spec_decode.decoder import SpecDecoder
    from vllm_metal.backends.mlx.runner.step import CarriedTokens
    from vllm_metal.kv.pool import KVPool
    from vllm_metal.kv.state_drafts import StepDrafts


@dataclass
class Forward:
    """A step up to the lazy hidden states of its packed tokens, handed to the output stage."""

    scheduler_output: SchedulerOutput
    packed: PackedBatch
    hidden: mx.array  # [T, ...], not evaluated yet
    started: float  # perf_counter() when execute_model began
    kv_arrays: list[mx.array]  # the pool's arrays, evaluated with the step (its cache writes)
    connector: ConnectorSteps | None  # collects the step's KV transfers once it is queued
    # A hybrid model's states of requests verifying drafts, stored once they are sampled.
    drafts: StepDrafts | None = None
    kv_pool: KVPool | None = None  # the pool the step ran on
    aux_hidden: mx.array | None = None  # the aux states an EAGLE-3 head reads (`AuxHidden`)
    traced: bool = False  # the compiled forward traced a new shape for the step


class OutputStage(Protocol):
    lm_head: ClassVar[bool]  # whether the model loads with its LM head
    features: ClassVar[frozenset[str]]  # runner features (`FEATURE_FLAGS`) the stage allows
    spec: SpecDecoder | None  # speculative decoding, verified where tokens are sampled

    def load(self, state: ModelState) -> None:
        """After the model loads: what the stage builds over it (the pooler)."""
        ...

    def supported_tasks(self, state: ModelState) -> tuple[SupportedTask, ...]: ...

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """After the request state took the scheduler's changes."""
        ...

    def finish_step(self, state: ModelState, forward: Forward) -> ModelRunnerOutput | None:
        """The step from the lazy hidden states on: its output now, or None when it comes from
        `sample_tokens`."""
        ...

    def drain(
        self, scheduler_output: SchedulerOutput, shifts: bool
    ) -> CarriedTokens | CarriedDrafts | None:
        """Before the next step (`scheduler_output`): finish the steps still pending whose
        tokens it needs on the host; a pending step whose tokens stay on the device for it
        returns them (with its drafts where `shifts`: the next step's forward can take its
        positions from the device)."""
        ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None: ...


def output_stage_class(vllm_config: VllmConfig) -> type[OutputStage]:
    """`Pooling` for `--runner pooling`, else `Sampling`."""
    if vllm_config.model_config.runner_type == "pooling":
        from vllm_metal.backends.mlx.runner.pool.pooling import Pooling

        return Pooling
    from vllm_metal.backends.mlx.runner.sample import Sampling

    return Sampling
