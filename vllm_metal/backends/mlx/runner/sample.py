"""Sampling, the output stage of generating models (`output.py`): a step's logits are queued on
the device and sampled with vLLM's own `Sampler` (grammar bitmask included), or its
`RejectionSampler` on a step that verifies drafts (`spec_decode/verify.py`); a step whose rows
read nothing but their logits, temperature, top-k and top-p (greedy, or unseeded) takes the
tokens (and raw logprobs) drawn on the device instead, and its logits never reach the host
(`tokens_on_device`, `device_sampling.py`); token write-back into the request state, and the step's
`ModelRunnerOutput`."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
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
from vllm_metal.backends.mlx.runner.device_sampling import (
    DeviceSampler,
    grammar_masked,
    raw_logprobs,
)
from vllm_metal.backends.mlx.runner.prompt_logprobs import (
    gather_prompt_logprobs,
    prompt_logprob_rows,
)
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.spec_decode import make_spec_decoder
from vllm_metal.backends.mlx.runner.step import CarriedTokens, StepPipeline, StepState
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
        tokens = self.device.tokens(logits, batch) if logits.size else None
        logprobs = None
        if tokens is not None:
            metadata = batch.sampling_metadata
            logprobs = raw_logprobs(logits, tokens, metadata, self.logprobs_mode)
        # Evaluating the cache writes with the logits keeps every step's graph self-contained.
        pending = [logits, *prompt_logits.values(), *forward.kv_arrays]
        if forward.aux_hidden is not None:
            pending.append(forward.aux_hidden)
        mx.async_eval(*pending, *([] if tokens is None else [tokens]), *(logprobs or ()))
        connector, scheduler_output = forward.connector, forward.scheduler_output
        self.pipeline.executed = StepState(
            scheduler_output,
            packed,
            logits,
            prompt_logits,
            device_tokens=tokens,
            device_logprobs=logprobs,
            started=forward.started,
            kv_connector_output=None if connector is None else connector.finish(scheduler_output),
            drafts=forward.drafts,
            hidden=forward.hidden if self._drafter_reads_hidden else None,
            kv_pool=forward.kv_pool if self._drafter_reads_target_kv else None,
            aux_hidden=forward.aux_hidden,
        )

    def drain(self) -> CarriedTokens | None:
        step = self.pipeline.drain(self._carries)
        return None if step is None else CarriedTokens.of(step)

    def _carries(self, step: StepState) -> bool:
        """Whether the next step may take `step`'s tokens on the device, leaving it pending:
        its output is the tokens drawn on the device, and nothing before the next forward reads
        them on the host (no drafter proposes from them, no penalty counts them; a pipeline
        stage before the last takes its tokens from the scheduler)."""
        metadata = self.states.input_batch.sampling_metadata
        return (
            self.spec is None
            and not self.states.tokens_from_scheduler
            and not self.states.num_prompt_logprobs
            and metadata.no_penalties
            and tokens_on_device(step, metadata)
        )

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
    """The step's output: its tokens drawn on the device where they may be (`device` draws a
    grammar step's tokens again over the masked logits), else by vLLM's samplers on the host."""
    batch = states.input_batch
    if step.carried or (
        not states.num_prompt_logprobs and tokens_on_device(step, batch.sampling_metadata)
    ):
        return _device_output(step, states)
    if device is not None and _grammar_on_device(step, states, device):
        return _device_output(step, states)
    seeded_rows = _seeded_apart(step, states)
    if seeded_rows is not None:
        drawn = seeded.sample_apart(
            sampler, to_torch(step.logits[mx.array(seeded_rows)]), seeded_rows, states
        )
        return _device_output(step, states, dict(zip(seeded_rows, drawn)))
    logits = to_torch(step.logits)  # waits for the forward
    if step.grammar_output is not None:
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        apply_grammar_bitmask(*_grammar_for_step_drafts(step, batch), batch, logits)

    seeded.reseed(states)
    if step.packed.num_draft_tokens.any():
        assert rejection_sampler is not None, "drafts scheduled without speculative decoding"
        from vllm_metal.backends.mlx.runner.spec_decode.verify import verify

        sampled, logprobs = verify(rejection_sampler, logits, step.packed, states)
    else:
        sampled, logprobs = _sample(sampler, logits, batch, step.packed.discard)
    prompt_logprobs = gather_prompt_logprobs(
        states, step.packed, step.prompt_logits, sampler, logprobs_mode
    )
    return _recorded(states, step.packed.req_ids, sampled, logprobs, prompt_logprobs)


def _grammar_for_step_drafts(step: StepState, batch) -> tuple:
    """The scheduler output and grammar bitmask laid out for the drafts the step verifies.

    vLLM lays the bitmask out for its own drafts of each structured-output request (1 + drafts
    rows, placeholders included); under async scheduling the step may verify fewer (placeholders
    without a draft are left out, `request_state.fill_placeholders`): each request keeps its
    first 1 + (drafts in the step) rows, and the logits are laid out by the step's drafts.
    """
    grammar = step.grammar_output
    theirs = step.scheduler_output.scheduled_spec_decode_tokens
    ours = {r: batch.spec_token_ids[i] for i, r in enumerate(batch.req_ids)}
    if all(len(ours[r]) == len(theirs.get(r, ())) for r in ours):
        return step.scheduler_output, grammar
    rows: list[int] = []
    start = 0
    for req_id in grammar.structured_output_request_ids:
        rows.extend(range(start, start + 1 + len(ours.get(req_id, ()))))
        start += 1 + len(theirs.get(req_id, ()))
    view = SimpleNamespace(scheduled_spec_decode_tokens={r: d for r, d in ours.items() if d})
    return view, replace(grammar, grammar_bitmask=grammar.grammar_bitmask[rows])


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


def tokens_on_device(
    step: StepState, metadata, seeded_apart: bool = False, grammar_on_device: bool = False
) -> bool:
    """Whether the step's tokens are those drawn on the device (`step.device_tokens`: every
    row's argmax, or unseeded samples beside greedy rows, after the penalties;
    `DeviceSampler.tokens` draws them only for such steps) as vLLM's `Sampler` would pick them:
    no logprobs but those drawn with them (`step.device_logprobs`), no grammar, no drafts, no
    prompt logprobs, and nothing else applied to the logits before sampling (allowed or bad
    words, a logit bias, min tokens, a thinking budget, custom logits processors), and no
    seeded row (`seeded_apart`: but for its seeded rows, which `_seeded_apart` draws); a
    grammar only where `grammar_on_device` (`_grammar_on_device` masks and draws again)."""
    if step.device_tokens is None or step.prompt_logits:
        return False
    if step.grammar_output is not None and not grammar_on_device:
        return False
    if metadata.generators and not seeded_apart:  # seeded rows: drawn on the host
        return False
    if step.packed.num_draft_tokens.any():
        return False
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    return bool(
        (metadata.max_num_logprobs is None or step.device_logprobs is not None)
        and not metadata.logprob_token_ids
        and metadata.allowed_token_ids_mask is None
        and not metadata.bad_words_token_ids
        and (holder is None or not holder.has_tracked_requests())
        and not any(_moves_argmax(p) for p in metadata.logitsprocs.non_argmax_invariant)
    )


def _moves_argmax(processor) -> bool:
    """vLLM's built-in logit bias and min-tokens processors act only for requests that ask for
    them; any other processor that may move the argmax is assumed to."""
    if isinstance(processor, LogitBiasLogitsProcessor):
        return bool(processor.biases)
    if isinstance(processor, MinTokensLogitsProcessor):
        return bool(processor.min_toks)
    return True


def _grammar_on_device(step: StepState, states: RequestStates, device: DeviceSampler) -> bool:
    """Whether the step's grammars were applied on the device and its tokens drawn again over
    the masked logits (`device_sampling.grammar_masked`; `step.device_tokens` replaced): a
    step without drafts, logprobs or seeded rows, whose tokens are otherwise the device's."""
    grammar = step.grammar_output
    metadata = states.input_batch.sampling_metadata
    if grammar is None or step.device_logprobs is not None or states.num_prompt_logprobs:
        return False
    if not tokens_on_device(step, metadata, grammar_on_device=True):
        return False
    index = {req_id: i for i, req_id in enumerate(step.packed.req_ids)}
    kept = [j for j, r in enumerate(grammar.structured_output_request_ids) if r in index]
    rows = np.array([index[grammar.structured_output_request_ids[j]] for j in kept], np.int64)
    masked = grammar_masked(step.logits, rows, grammar.grammar_bitmask[kept])
    tokens = device.tokens(masked, states.input_batch)
    if tokens is None:
        return False
    step.device_tokens = tokens
    return True


def _seeded_apart(step: StepState, states: RequestStates) -> list[int] | None:
    """The seeded rows of a step whose tokens are otherwise those drawn on the device, when
    they can be drawn apart on the host (`seeded.host_rows`); None when the whole step goes to
    the host."""
    metadata = states.input_batch.sampling_metadata
    if not metadata.generators or states.num_prompt_logprobs or step.device_logprobs is not None:
        return None
    if not tokens_on_device(step, metadata, seeded_apart=True):
        return None
    return seeded.host_rows(states)


def _device_output(
    step: StepState, states: RequestStates, host: dict[int, int] | None = None
) -> ModelRunnerOutput:
    """The step's output from the tokens (and logprobs) drawn on the device, but the rows of
    `host` (row -> token), drawn on the host (waits for the forward)."""
    tokens = to_host(step.device_tokens).tolist()
    for row, token in (host or {}).items():
        tokens[row] = token
    sampled = [[] if drop else [token] for token, drop in zip(tokens, step.packed.discard)]
    logprobs = None
    if step.device_logprobs is not None:
        ids, values, ranks = (to_host(a) for a in step.device_logprobs)
        logprobs = LogprobsLists(ids, values, ranks.astype(np.int64), None)
    return _recorded(states, step.packed.req_ids, sampled, logprobs, {})


def _sample(sampler: Sampler, logits, batch, discard: np.ndarray):
    sampler_output = sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
    sampled = sampler_output.sampled_token_ids.tolist()
    for i in np.nonzero(discard)[0]:
        sampled[int(i)] = []

    logprobs = None
    if sampler_output.logprobs_tensors is not None:
        logprobs = sampler_output.logprobs_tensors.tolists()
    return sampled, logprobs
