"""Sampling, the output stage of generating models (`output.py`): a step's logits are queued on
the device with the tokens (and raw logprobs) drawn there (`device_sampling.py`, after each
request's rules, `logits_rules.py`), and the step takes those tokens unless something the device
does not do sends it to vLLM's own samplers on the host (`host_route`):
its `Sampler` (grammar bitmask included), or its `RejectionSampler` on a step that verifies
drafts (`spec_decode/verify.py`), where the device's verdicts do not serve (rows greedy or sampled
with a temperature, top-k and top-p alone). Token write-back into the request state, and the
step's `ModelRunnerOutput`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler

from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.device_sampling import DeviceSampler
from vllm_metal.backends.mlx.runner.grammar import grammar_for_step_drafts, redraw_grammar_rows
from vllm_metal.backends.mlx.runner.prompt_logprobs import (
    gather_prompt_logprobs,
    prompt_logprob_rows,
)
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.spec_decode import make_spec_decoder
from vllm_metal.backends.mlx.runner.spec_decode.ahead import CarriedDrafts
from vllm_metal.backends.mlx.runner.spec_decode.verify import (
    device_verdicts,
    verdict_logprobs,
    verdict_outputs,
    verifies_on_device,
    verify,
)
from vllm_metal.backends.mlx.runner.step import (
    CarriedTokens,
    StepPipeline,
    StepState,
    unrecorded_outputs,
)
from vllm_metal.backends.mlx.runner.tensors import to_host, to_torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.output import Forward


class Sampling:
    """Steps end in logits, queued with `mx.async_eval` and sampled when their tokens are needed
    (`step.py`); drafts of speculative decoding are verified here."""

    lm_head = True
    features = frozenset({"lora", "speculative_decoding", "kv_connector"})

    def __init__(self, vllm_config: VllmConfig, states: RequestStates, state: ModelState):
        self.states = states
        self.logprobs_mode = vllm_config.model_config.logprobs_mode
        self.sampler = Sampler(logprobs_mode=self.logprobs_mode)
        self.device = DeviceSampler(vllm_config.model_config.seed)
        async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self.pipeline = StepPipeline(self._sample, async_scheduling)
        self.spec = make_spec_decoder(vllm_config, self.sampler, state)
        self.verified_on_device = 0  # steps whose drafts the device verified (tests read it)
        self._next: SchedulerOutput | None = None  # the step `drain` is called before
        self._shifts = False

    def load(self, state: ModelState) -> None:
        pass

    @property
    def _drafter_reads_hidden(self) -> bool:
        return self.spec is not None and self.spec.drafter.reads_hidden_states

    @property
    def _drafter_reads_target_kv(self) -> bool:
        return self.spec is not None and self.spec.drafter.reads_target_kv

    def supported_tasks(self, state: ModelState) -> tuple[SupportedTask, ...]:
        return state.generation_tasks()

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        pass

    def finish_step(self, state: ModelState, forward: Forward) -> None:
        """Queue the step's logits; `sample_tokens` (or the next step) samples them."""
        packed = forward.packed
        prompt_rows = prompt_logprob_rows(self.states, packed)
        logits, prompt_logits = state.logits(forward.hidden, packed, prompt_rows)
        batch = self.states.input_batch
        drafts = packed.num_draft_tokens.any()
        on_device = drafts and verifies_on_device(self.states)
        keyed = None  # a seeded row's noise, made only for rows drawn on the device
        if (not drafts or on_device) and batch_on_host(batch.sampling_metadata) is None:
            keyed = seeded.keyed_noise(self.states, packed, logits.shape[-1])
        tokens, logprobs, values = self.device.outputs(
            logits, batch, self.logprobs_mode, unrecorded_outputs(packed), keyed
        )
        verdicts = None
        if on_device:
            chosen, accepts, processed = device_verdicts(
                logits, packed, batch, self.device.next_key(), keyed
            )
            verdicts = (chosen, accepts)
            logprobs, values = verdict_logprobs(
                logits, chosen, processed, batch.sampling_metadata, self.logprobs_mode
            )
        # Evaluating the cache writes with the logits keeps every step's graph self-contained.
        pending = [logits, *prompt_logits.values(), *forward.kv_arrays, *(verdicts or ())]
        if forward.aux_hidden is not None:
            pending.append(forward.aux_hidden)
        mx.async_eval(*pending, *([] if tokens is None else [tokens]), *(logprobs or ()))
        connector, scheduler_output = forward.connector, forward.scheduler_output
        step = self.pipeline.executed = StepState(
            scheduler_output,
            packed,
            logits,
            prompt_logits,
            device_tokens=tokens,
            device_logprobs=logprobs,
            logprob_values=values,
            keyed=keyed,
            verdicts=verdicts,
            started=forward.started,
            traced=forward.traced,
            kv_connector_output=None if connector is None else connector.finish(scheduler_output),
            drafts=forward.drafts,
            hidden=forward.hidden if self._drafter_reads_hidden else None,
            kv_pool=forward.kv_pool if self._drafter_reads_target_kv else None,
            aux_hidden=forward.aux_hidden,
        )
        if verdicts is not None and self.spec is not None:
            self.spec.queue(step, self.states)

    def drain(
        self, scheduler_output: SchedulerOutput, shifts: bool
    ) -> CarriedTokens | CarriedDrafts | None:
        self._next, self._shifts = scheduler_output, shifts
        step = self.pipeline.drain(self._carries)
        if step is None:
            return None
        if step.packed.num_draft_tokens.any():
            step.carried_drafts = CarriedDrafts.of(step)
            return step.carried_drafts
        return CarriedTokens.of(step)

    def _carries_drafts(self, step: StepState) -> bool:
        """Whether the next step may take a verifying step's tokens and the drafts queued
        behind it on the device (`ahead.CarriedDrafts`): the next step's forward takes its
        positions from the device (`shifts`), the drafts were queued, no grammar sends the step
        to the host, nothing reads the tokens on the host before the next forward, and the next
        step is the same requests verifying as many drafts."""
        metadata = self.states.input_batch.sampling_metadata
        return (
            self._shifts
            and step.queued is not None
            and step.grammar_output is None
            and not self.states.tokens_from_scheduler
            and not reads_outputs(metadata)
            and not self.states.num_prompt_logprobs
            and CarriedDrafts.fits(step, self._next)
        )

    def _carries(self, step: StepState) -> bool:
        """Whether the next step may take `step`'s tokens on the device, leaving it pending:
        its output is the tokens drawn on the device (no row drawn on the host; a grammar's
        rows drawn again over their masked logits here, on the device, as sampling would), and
        nothing before the next forward reads them on the host (the rules over a row's
        outputs so far count the carried ones, `step.unrecorded_outputs`; no prompt logprobs
        are pending, gathered when the step is sampled; a pipeline stage before the last takes
        its tokens from the scheduler; under speculative decoding, nobody drafts after the
        step, `SpecDecoder.plan_ahead`, weighed last: it decides)."""
        if step.packed.num_draft_tokens.any():
            return self._carries_drafts(step)
        if not (
            not self.states.tokens_from_scheduler
            and not self.states.num_prompt_logprobs
            and host_route(step, self.states, self.device) is None
            and (self.spec is None or self.spec.plan_ahead(step, self.states))
        ):
            return False
        if step.grammar_output is not None:
            redraw_grammar_rows(step, self.states, self.device, self.logprobs_mode)
        return True

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        return self.pipeline.hand_out(grammar_output)

    def _sample(self, step: StepState) -> ModelRunnerOutput:
        spec = self.spec
        output = sample_step(
            step,
            self.states,
            self.sampler,
            self.logprobs_mode,
            None if spec is None else spec.rejection_sampler,
            self.device,
        )
        self.verified_on_device += step.verdicts is not None
        if step.drafts is not None:  # a hybrid's states after the accepted drafts
            step.drafts.commit(np.array([max(len(t) - 1, 0) for t in output.sampled_token_ids]))
        if spec is not None:
            spec.after_step(step, self.states, output.sampled_token_ids)
        output.kv_connector_output = step.kv_connector_output
        return output


def sample_step(
    step: StepState,
    states: RequestStates,
    sampler: Sampler,
    logprobs_mode: str,
    rejection_sampler: RejectionSampler | None = None,
    device: DeviceSampler | None = None,
) -> ModelRunnerOutput:
    """The step's output: its tokens drawn on the device (a grammar step's drawn again over the
    masked logits, by `device`), or every row drawn by vLLM's samplers on the host when
    `host_route` sends the step there. Prompt logprobs are gathered from their own logits rows
    whichever way the tokens were drawn."""
    batch = states.input_batch
    if step.carried and step.verdicts is None:
        return _device_output(step, states)
    prompt_logprobs = gather_prompt_logprobs(
        states, step.packed, step.prompt_logits, sampler, logprobs_mode
    )
    if step.grammar_output is not None:
        step.verdicts = None  # the grammar's masks come first: the host verifies
    if step.verdicts is not None:
        sampled, logprobs = verdict_outputs(
            step.verdicts,
            step.device_logprobs,
            step.logprob_values,
            step.logits,
            step.packed,
            states,
            sampler,
            by_position=step.keyed is not None,
        )
        return _recorded(states, step.packed.req_ids, sampled, logprobs, prompt_logprobs)
    if host_route(step, states, device) is None:
        if step.grammar_output is not None:
            assert device is not None
            redraw_grammar_rows(step, states, device, logprobs_mode)
        return _device_output(step, states, prompt_logprobs)
    logits = to_torch(step.logits)  # waits for the forward
    if step.grammar_output is not None:
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        apply_grammar_bitmask(*grammar_for_step_drafts(step, batch), batch, logits)

    if step.packed.carried is not None:
        recount_min_tokens(batch.sampling_metadata)
    seeded.reseed(states)
    if step.packed.num_draft_tokens.any():
        assert rejection_sampler is not None, "drafts scheduled without speculative decoding"
        sampled, logprobs = verify(rejection_sampler, logits, step.packed, states)
    else:
        sampled, logprobs = _sample(sampler, logits, batch, step.packed.discard)
    return _recorded(states, step.packed.req_ids, sampled, logprobs, prompt_logprobs)


def host_route(
    step: StepState, states: RequestStates, device: DeviceSampler | None = None
) -> str | None:
    """Why the step's logits go to vLLM's samplers on the host (None: its tokens are those
    drawn on the device). A step goes to the host as a whole: vLLM's custom logits processors
    and its thinking-budget state take every row's logits at once, indexed by batch row, with
    no way to hand them a subset; drafts are verified over the whole step."""
    metadata = states.input_batch.sampling_metadata
    if step.packed.num_draft_tokens.any():
        return "drafts to verify"
    if step.device_tokens is None:
        return "the device drew no tokens (a custom processor acts on random rows)"
    if step.grammar_output is not None and device is None:
        return "a grammar, with no device sampler to draw its rows again"
    whole_batch = batch_on_host(metadata)
    if whole_batch is not None:
        return whole_batch
    if metadata.generators and step.keyed is None:
        return "seeded rows drawn without their own noise"
    return None


def batch_on_host(metadata) -> str | None:
    """Why every step of the batch as it stands goes to vLLM's samplers, whatever the step
    holds: a thinking budget or a logits processor the device does not apply."""
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return "a thinking budget"
    if any(not _built_in(p) for p in metadata.logitsprocs.non_argmax_invariant):
        return "a custom logits processor that may move the argmax"
    return None


def _built_in(processor) -> bool:
    """Whether the device applies `processor` (`logits_rules.apply_rules`)."""
    return isinstance(processor, (LogitBiasLogitsProcessor, MinTokensLogitsProcessor))


def reads_outputs(metadata) -> bool:
    """Whether some row's rules count its outputs so far (penalties, bad words, min tokens):
    a step verifying drafts, whose rules count the drafts instead, is then not carried."""
    min_tokens = (
        p for p in metadata.logitsprocs.non_argmax_invariant
        if isinstance(p, MinTokensLogitsProcessor)
    )  # fmt: skip
    return (
        not metadata.no_penalties
        or bool(metadata.bad_words_token_ids)
        or any(p.min_toks for p in min_tokens)
    )


def recount_min_tokens(metadata) -> None:
    """Let vLLM's min-tokens processor count the outputs again before its `Sampler` applies it:
    it counted them when the batch was updated, and the tokens carried into this step were
    recorded since."""
    for p in metadata.logitsprocs.non_argmax_invariant:
        if isinstance(p, MinTokensLogitsProcessor):
            p.update_state(None)


def _recorded(
    states: RequestStates,
    req_ids: list[str],
    sampled: list[list[int]],
    logprobs,
    prompt_logprobs: dict,
) -> ModelRunnerOutput:
    """Record the tokens of the step's rows (`req_ids`) in the request state; its output."""
    states.record_sampled(sampled, req_ids)
    return ModelRunnerOutput(
        req_ids=list(req_ids),
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs_dict=prompt_logprobs,
    )


def _device_output(
    step: StepState, states: RequestStates, prompt_logprobs: dict | None = None
) -> ModelRunnerOutput:
    """The step's output from the tokens (and logprobs) drawn on the device (waits for them)."""
    tokens = to_host(step.device_tokens).tolist()
    sampled = [[] if drop else [token] for token, drop in zip(tokens, step.packed.discard)]
    logprobs = None
    if step.device_logprobs is not None:
        ids, values, ranks = (to_host(a) for a in step.device_logprobs)
        logprobs = LogprobsLists(ids, values, ranks.astype(np.int64), None)
    return _recorded(states, step.packed.req_ids, sampled, logprobs, prompt_logprobs or {})


def _sample(sampler: Sampler, logits, batch, discard: np.ndarray):
    sampler_output = sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
    sampled = sampler_output.sampled_token_ids.tolist()
    for i in np.nonzero(discard)[0]:
        sampled[int(i)] = []

    logprobs = None
    if sampler_output.logprobs_tensors is not None:
        logprobs = sampler_output.logprobs_tensors.tolists()
    return sampled, logprobs
