"""Per-request state across steps, kept in vLLM's own `InputBatch` and updated from each
`SchedulerOutput`: new, resumed, preempted, finished and continuing requests, and their blocks.

The batch keeps decode requests before prefill chunks (the order `batch.py` packs), and builds
vLLM's sampling metadata for the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.sampling_params import SamplingType
from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

# vLLM-side tensors (sampling metadata, generators) live on the host.
HOST = torch.device("cpu")


def max_context_len(vllm_config: VllmConfig) -> int:
    """The most tokens a request keeps in one KV-cache group: `max_model_len`, or for an
    encoder-decoder model the encoder budget if larger (its cross-attention group holds the
    encoder states), as vLLM's own runner sizes its block tables."""
    model_len = vllm_config.model_config.max_model_len
    if not vllm_config.model_config.is_encoder_decoder:
        return model_len
    return max(model_len, vllm_config.scheduler_config.max_num_encoder_input_tokens)


class RequestStates:
    def __init__(self, vllm_config: VllmConfig, block_sizes: list[int]):
        self.vllm_config = vllm_config
        self.max_context_len = max_context_len(vllm_config)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.is_pooling = vllm_config.model_config.runner_type == "pooling"
        self.requests: dict[str, CachedRequestState] = {}
        # req_id -> number of prompt logprobs asked for, while the prompt is being processed
        self.num_prompt_logprobs: dict[str, int] = {}
        self.block_sizes = list(block_sizes)  # one per KV-cache group
        spec = vllm_config.speculative_config
        self.num_spec_tokens = 0 if spec is None else spec.num_speculative_tokens
        self.input_batch = self._make_input_batch(self.block_sizes)
        # A pipeline stage before the last samples nothing: the scheduler sends each step's
        # tokens back (`CachedRequestData.new_token_ids`), sampled ones included.
        self.tokens_from_scheduler = False
        # req_id -> tokens computed once its last sampled step's rejected drafts are dropped
        # (`SpecDecoder.after_step`). Under async scheduling the scheduler plans a step before
        # it has seen the previous one's rejections and counts every draft as computed.
        self.computed_after_step: dict[str, int] = {}
        # req_id -> placeholders of this step the runner had no draft for: left out of the
        # step (`num_scheduled`), which the scheduler counts as rejected drafts.
        self.unfilled: dict[str, int] = {}

    def _make_input_batch(self, block_sizes: list[int]) -> InputBatch:
        config = self.vllm_config
        max_model_len = self.max_context_len
        custom = tuple(config.model_config.logits_processors or ())
        return InputBatch(
            max_num_reqs=config.scheduler_config.max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            device=HOST,
            vocab_size=self.vocab_size,
            block_sizes=block_sizes,
            max_num_blocks_per_req=[math.ceil(max_model_len / bs) for bs in block_sizes],
            logitsprocs=build_logitsprocs(config, HOST, False, self.is_pooling, custom),
            logitsprocs_need_output_token_ids=bool(custom),
            num_spec_tokens=self.num_spec_tokens,
            is_pooling_model=self.is_pooling,
            reasoning_config=config.reasoning_config,
        )

    def set_block_sizes(self, block_sizes: list[int]) -> None:
        """Rebuild the (empty) batch for the KV-cache groups vLLM chose."""
        if self.block_sizes != list(block_sizes):
            assert not self.input_batch.req_ids, "block sizes change only before serving"
            self.block_sizes = list(block_sizes)
            self.input_batch = self._make_input_batch(self.block_sizes)

    def update(
        self,
        scheduler_output: SchedulerOutput,
        proposed: dict[str, list[int]] | None = None,
    ) -> None:
        """The scheduler's changes; `proposed`: under async scheduling, the drafts proposed after
        the previous step, which stand in for the scheduler's `-1` placeholders."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self.computed_after_step.pop(req_id, None)
            self.num_prompt_logprobs.pop(req_id, None)
            batch.remove_request(req_id)

        # Requests in the persistent batch that were not scheduled this step (paused or
        # preempted) leave the batch; their state stays in self.requests. Resumed requests
        # leave it too: they come back with replacement blocks.
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        cached = scheduler_output.scheduled_cached_reqs
        drafts = scheduler_output.scheduled_spec_decode_tokens
        self.unfilled = {}
        if proposed is not None:
            filled = {r: fill_placeholders(d, proposed.get(r, ())) for r, d in drafts.items()}
            self.unfilled = {r: len(d) - len(filled[r]) for r, d in drafts.items()}
            drafts = filled
            _report_unfilled(scheduler_output, self.unfilled)
        for req_id in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        to_add = [self._add_new(new) for new in scheduler_output.scheduled_new_reqs]

        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            num_computed = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            num_output = cached.num_output_tokens[i]
            index = batch.req_id_to_index.get(req_id)
            if req_id not in cached.resumed_req_ids:
                num_computed = min(num_computed, self.computed_after_step.get(req_id, num_computed))
            state.num_computed_tokens = num_computed
            if num_output < len(state.output_token_ids):
                # The scheduler dropped tokens (e.g. rejected); keep our copy in step.
                del state.output_token_ids[num_output:]
                if index is not None:
                    batch.num_tokens_no_spec[index] = batch.num_prompt_tokens[index] + num_output
            if self.tokens_from_scheduler and cached.new_token_ids:
                self._take_sampled(state, index, num_computed, cached.new_token_ids[i])
            if req_id in cached.resumed_req_ids:
                assert new_block_ids is not None
                state.block_ids = new_block_ids
            elif new_block_ids is not None:
                for ids, extra in zip(state.block_ids, new_block_ids):
                    ids.extend(extra)
            if index is None:
                to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[index] = num_computed
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, index)
            # Drafts to verify go after the known tokens (or clear last step's).
            batch.update_req_spec_token_ids(state, drafts)

        for state in to_add:
            batch.add_request(state)
            batch.update_req_spec_token_ids(state, drafts)
        batch.condense()
        # A row verifying drafts counts as a decode, as on vLLM's GPU runner.
        reorder_batch_to_split_decodes_and_prefills(
            batch, scheduler_output, decode_threshold=1 + self.num_spec_tokens
        )
        batch.refresh_metadata()

    def _take_sampled(
        self, state: CachedRequestState, index: int | None, num_computed: int, scheduled: list[int]
    ) -> None:
        """The tokens of `scheduled` (this step's tokens from `num_computed` on) that this stage
        has not seen: the last stage's samples."""
        new = num_computed + len(scheduled) - state.num_tokens
        if new <= 0:
            return
        sampled = scheduled[-new:]
        state.output_token_ids.extend(sampled)
        if index is not None:
            batch = self.input_batch
            start = int(batch.num_tokens_no_spec[index])
            batch.token_ids_cpu[index, start : start + new] = sampled
            batch.is_token_ids[index, start : start + new] = True
            batch.num_tokens_no_spec[index] = start + new

    def _add_new(self, new) -> CachedRequestState:
        if new.prompt_token_ids is None:
            raise ValueError(f"request {new.req_id}: prompt embeddings are not supported")
        if new.req_id in self.requests:
            return self._continue_streaming(new)
        params = new.sampling_params
        generator = None
        if params is not None and params.sampling_type == SamplingType.RANDOM_SEED:
            generator = torch.Generator(device=HOST)
            generator.manual_seed(params.seed)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            mm_features=new.mm_features,
            sampling_params=params,
            pooling_params=new.pooling_params,
            generator=generator,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=[],
            lora_request=new.lora_request,
        )
        self.requests[new.req_id] = state
        if params is not None and params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            self.num_prompt_logprobs[new.req_id] = self.vocab_size if k == -1 else k
        return state

    def _continue_streaming(self, new) -> CachedRequestState:
        """A streaming session's next turn: the earlier outputs are now part of the prompt.

        The request keeps its state object, so a seeded request continues its random stream
        instead of replaying it (as on vLLM's other backends).
        """
        self.input_batch.remove_request(new.req_id)
        state = self.requests[new.req_id]
        state.prompt_token_ids = new.prompt_token_ids
        state.num_prompt_tokens = len(new.prompt_token_ids)
        state.mm_features = new.mm_features
        state.sampling_params = new.sampling_params
        state.block_ids = new.block_ids
        state.num_computed_tokens = new.num_computed_tokens
        state.output_token_ids.clear()
        return state

    def num_scheduled(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """This step's tokens per request, less the placeholders left unfilled (`update`)."""
        counts = scheduler_output.num_scheduled_tokens
        if not self.unfilled:
            return counts
        return {r: n - self.unfilled.get(r, 0) for r, n in counts.items()}

    def num_draft_tokens(self) -> np.ndarray:
        """Drafts each row verifies this step ([num_reqs] int32)."""
        batch = self.input_batch
        return np.fromiter(
            (len(batch.spec_token_ids[i]) for i in range(batch.num_reqs)),
            dtype=np.int32,
            count=batch.num_reqs,
        )

    def record_sampled(
        self, sampled: list[list[int]], req_ids: Sequence[str] | None = None
    ) -> None:
        """Append each row's sampled tokens to its request's outputs and, while the request is
        in the batch, to its batch row. `req_ids`: the rows' requests when the step was packed
        (default: the batch's rows now); a later step may have moved, dropped or finished
        them since (`step.CarriedTokens`)."""
        batch = self.input_batch
        for req_id, token_ids in zip(req_ids or batch.req_ids, sampled):
            state = self.requests.get(req_id)
            if not token_ids or state is None:
                continue
            state.output_token_ids.extend(token_ids)
            i = batch.req_id_to_index.get(req_id)
            if i is None:
                continue
            start = int(batch.num_tokens_no_spec[i])
            end = start + len(token_ids)
            batch.token_ids_cpu[i, start:end] = token_ids
            batch.is_token_ids[i, start:end] = True
            batch.num_tokens_no_spec[i] = end


def _report_unfilled(scheduler_output: SchedulerOutput, unfilled: dict[str, int]) -> None:
    """Name the placeholders the runner had no draft for in the scheduler output's
    `num_invalid_spec_tokens`, which vLLM's spec-decode statistics take off the step's draft
    counts (as they take off drafts a grammar rejects), so the acceptance rate is that of the
    drafts proposed. vLLM reads this very object back with the step's output where the worker
    runs in the engine core's process (the `uni` executor, the default here); elsewhere, and
    where vLLM sets the field again for a grammar's drafts, the counts stay vLLM's."""
    invalid = {r: n for r, n in unfilled.items() if n}
    if invalid:
        known = scheduler_output.num_invalid_spec_tokens or {}
        scheduler_output.num_invalid_spec_tokens = {**known, **invalid}


def fill_placeholders(scheduled: list[int], proposed: Sequence[int]) -> list[int]:
    """The scheduler's `-1` placeholders of a request replaced, in order, by the drafts proposed
    for it, up to the first placeholder without one: a placeholder left out is a draft
    rejected without being verified (the scheduler rolls back every unaccepted one)."""
    out = []
    for j, token in enumerate(scheduled):
        if token < 0:
            if j >= len(proposed):
                break
            token = proposed[j]
        out.append(token)
    return out
