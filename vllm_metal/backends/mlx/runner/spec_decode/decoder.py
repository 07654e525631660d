"""Speculative decoding for the runner: after each step, record how the drafts fared and what the
step cost, decide who may draft and how many, and keep the drafts for vLLM's
`take_draft_token_ids`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from vllm.sampling_params import SamplingType
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.sample.rejection_sampler import RejectionSampler

from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.spec_decode.backoff import Backoff
from vllm_metal.backends.mlx.runner.spec_decode.drafter import Drafter, sampled_counts

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState


class SpecDecoder:
    def __init__(
        self, vllm_config: VllmConfig, sampler: Sampler, drafter: Drafter, backoff: Backoff
    ):
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.drafter = drafter
        self.backoff = backoff
        self.rejection_sampler = RejectionSampler(sampler, spec)
        self._drafts: DraftTokenIds | None = None
        # Under async scheduling vLLM schedules each step before the previous one is sampled,
        # with `-1` placeholders for its drafts: the runner puts in the drafts it proposed
        # (`proposed`) and corrects the positions for the previous step's rejections.
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self._proposed: dict[str, list[int]] = {}
        self._recorded_at = 0.0  # perf_counter() when the last step's output was recorded
        self._drafted = 0.0  # seconds the drafter took after it

    def after_step(self, step: StepState, states: RequestStates, sampled: list[list[int]]) -> None:
        """Called once the step's tokens are recorded in `states`. A step planned ahead and
        carried (`plan_ahead`) has only its rate left to record: the batch has moved on since."""
        if step.carried:
            if step.carried_drafts is not None:
                self._settle(step, states, sampled)
            self._record_rate(step, sampled, verified=step.carried_drafts is not None)
            return
        batch = states.input_batch
        verified = False
        for i, req_id in enumerate(batch.req_ids):
            real = sum(1 for t in batch.spec_token_ids[i] if t >= 0)  # -1: placeholders
            if real and sampled[i]:
                verified = True
                self.backoff.record_verification(req_id, real, len(sampled[i]) - 1)
        num_sampled = sampled_counts(sampled)
        self._record_positions(step, states, num_sampled)
        self._record_rate(step, sampled, verified)
        caps = step.spec_caps if step.spec_caps is not None else self.caps(states, num_sampled)
        started = time.perf_counter()
        drafts = self.drafter.propose(step, states, sampled, caps)
        self._drafted = time.perf_counter() - started
        self._keep(batch.req_ids, [list(d[:c]) for d, c in zip(drafts, caps.tolist())])

    def _settle(self, step: StepState, states: RequestStates, sampled: list[list[int]]) -> None:
        """A verifying step whose tokens and next drafts the next step took on the device
        (`ahead.CarriedDrafts`), once its tokens are on the host: the drafts' verdicts recorded,
        the drafts kept for vLLM, and the next step's host records made what the device used
        (`CarriedDrafts.settle`)."""
        assert step.queued is not None and step.carried_drafts is not None
        drafts = step.queued.take(step, sampled)
        if drafts is None:
            raise RuntimeError(
                "a step's tokens differ from those its verdicts gave the next step on the device"
            )
        num_draft = step.packed.num_draft_tokens
        for req_id, n, tokens in zip(step.packed.req_ids, num_draft.tolist(), sampled):
            self.backoff.record_verification(req_id, n, len(tokens) - 1)
        rejected = num_draft - sampled_counts(sampled) + 1
        step.carried_drafts.settle(states, rejected, drafts)
        caps = step.spec_caps.tolist() if step.spec_caps is not None else []
        self._keep(step.packed.req_ids, [d[:c] for d, c in zip(drafts, caps, strict=True)])

    def plan_ahead(self, step: StepState, states: RequestStates) -> bool:
        """Before the step's tokens reach the host, as the next step is about to be built: under
        async scheduling, a step that verified no drafts returns one token per row that samples,
        so who drafts after it is decided now (once: `after_step` keeps the decision). True
        where nobody does and the drafter keeps up without the step's tokens: the next step may
        then take them on the device (`step.CarriedTokens`), with no draft in its placeholders."""
        packed = step.packed
        if not self.async_scheduling or packed.num_draft_tokens.any():
            return False
        num_sampled = (~packed.discard).astype(np.int32)
        caps = step.spec_caps = self.caps(states, num_sampled, unrecorded=num_sampled)
        if caps.any():
            return False
        if not self.drafter.keeps_up(step, states, num_sampled):
            return False
        self._record_positions(step, states, num_sampled)
        self._keep(states.input_batch.req_ids, [[] for _ in caps])
        return True

    def queue(self, step: StepState, states: RequestStates) -> None:
        """As a step that verifies drafts is queued, under async scheduling: where the drafter
        may propose on the device behind it (`Drafter.may_queue`), who drafts after the step is
        decided now (once: `after_step` keeps the decision; no row knows yet how many of its
        drafts are accepted, so each is capped as if all were), and the drafts are queued."""
        if not self.async_scheduling or not self.drafter.may_queue(step, states):
            return
        num_draft = step.packed.num_draft_tokens
        ones = np.ones_like(num_draft)
        caps = step.spec_caps = self.caps(states, ones, unrecorded=num_draft + 1)
        self.drafter.queue(step, states, caps)

    def _record_positions(
        self, step: StepState, states: RequestStates, num_sampled: np.ndarray
    ) -> None:
        """Under async scheduling, each row's tokens computed and kept after the step (the next
        step's placeholders count every draft as accepted)."""
        if not self.async_scheduling:
            return
        batch = states.input_batch
        for i, req_id in enumerate(batch.req_ids):
            scheduled = len(batch.spec_token_ids[i])
            rejected = scheduled - int(num_sampled[i]) + 1 if num_sampled[i] else 0
            states.computed_after_step[req_id] = (
                int(batch.num_computed_tokens_cpu[i]) + int(step.packed.num_scheduled[i]) - rejected
            )

    def _record_rate(self, step: StepState, sampled: list[list[int]], verified: bool) -> None:
        """The step's token rate, for decode steps only (one known token per row, drafts aside:
        a prefill chunk's cost says nothing about what drafting costs) that traced no new
        compiled shape (tracing it and building its kernels costs many steps' time, once). Its
        cost is the time since the previous step's output was recorded, which includes the
        drafting done after that output; where the step began only after that drafting (the
        engine waited between), the time since its start and the drafting instead. A step
        carried one ahead starts before the previous one's output, and a step that verifies
        drafts under async scheduling starts before they are proposed: either way no time counts
        twice, so neither mode is measured slower than it runs. A step without drafts after which
        drafting was already decided (`plan_ahead`) is not timed either: nothing was built while
        it ran (the next step waits for its drafts), so it looks cheaper than the steps of its
        mode, and the change of mode is paid by the next one."""
        now = time.perf_counter()
        since = max(self._recorded_at, step.started - self._drafted)
        self._recorded_at, self._drafted = now, 0.0
        if step.traced or not step.packed.decodes_only:
            return
        if not verified and step.spec_caps is not None and step.spec_caps.any():
            return
        tokens = sum(len(s) for s in sampled)
        self.backoff.record_decode_step(len(step.packed.req_ids), tokens, now - since, verified)

    def _keep(self, req_ids: list[str], drafts: list[list[int]]) -> None:
        self._drafts = DraftTokenIds(list(req_ids), drafts)
        if self.async_scheduling:
            self._proposed = dict(zip(self._drafts.req_ids, self._drafts.draft_token_ids))

    def caps(
        self,
        states: RequestStates,
        num_sampled: np.ndarray,
        unrecorded: np.ndarray | None = None,
    ) -> np.ndarray:
        """The most drafts each row may propose for the next step, after it sampled
        `num_sampled[i]` tokens (`unrecorded[i]` of them not yet in the batch).

        A verified row returns up to drafts + 1 tokens, so drafts stop one short of the
        request's remaining `max_tokens` and of `max_model_len`: a request near its end neither
        drafts nor verifies tokens it cannot return. Under async scheduling only `max_model_len`
        caps them: the scheduler has already placed its placeholders, and drafts verified past
        `max_tokens` are dropped by it, as on vLLM's GPU runner, while a placeholder left out
        would count as a rejected draft in its metrics. A seeded sampled request drafts only where
        its drafts can be verified by position (`seeded.drafts_by_position`), which keeps its
        tokens those of decoding without drafts whenever the back-off lets it draft: a seed
        promises the same tokens every run. The back-off then keeps only the rows where
        drafting pays.
        """
        batch = states.input_batch
        caps = np.zeros(batch.num_reqs, dtype=np.int32)
        if not self.backoff.batch_drafts(int(np.count_nonzero(num_sampled))):
            return caps
        pending = np.zeros(batch.num_reqs, np.int32) if unrecorded is None else unrecorded
        for i, req_id in enumerate(batch.req_ids):
            if not num_sampled[i]:
                continue
            state = states.requests[req_id]
            params = state.sampling_params
            seeded_row = params is not None and params.sampling_type == SamplingType.RANDOM_SEED
            if seeded_row and not seeded.drafts_by_position(params):
                continue
            if self.async_scheduling and params is not None and params.structured_outputs:
                # vLLM checks drafts against the grammar only after the runner has put them in
                # the step: a request with a grammar does not draft under async scheduling.
                continue
            cap = min(
                self.num_speculative_tokens,
                self.max_model_len - int(batch.num_tokens_no_spec[i]) - pending[i] - 1,
            )
            max_tokens = state.sampling_params.max_tokens if state.sampling_params else None
            if max_tokens is not None and not self.async_scheduling:
                cap = min(cap, max_tokens - len(state.output_token_ids) - pending[i] - 1)
            caps[i] = max(cap, 0)
        return np.array(self.backoff.per_request(batch.req_ids, caps.tolist()), dtype=np.int32)

    def proposed(self) -> dict[str, list[int]] | None:
        """Under async scheduling, the drafts proposed after the last sampled step, by request:
        what the next step's placeholders stand for (None without async scheduling)."""
        return self._proposed if self.async_scheduling else None

    def take(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    def forget(self, req_id: str) -> None:
        """A finished request."""
        self.backoff.forget(req_id)
        self.drafter.reset(req_id)

    def restart(self, scheduler_output) -> None:
        """Requests that start over on new blocks (resumed after preemption, or a streaming
        session's next turn): a draft model recomputes them."""
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            self.drafter.reset(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.drafter.reset(new.req_id)
