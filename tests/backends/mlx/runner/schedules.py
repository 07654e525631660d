"""Hand-built vLLM schedules for the runner's unit tests, filled the way vLLM's scheduler fills
them, and the runner's update-then-pack sequence."""

from __future__ import annotations

from typing import NamedTuple

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from vllm_metal.backends.mlx.runner.batch import PackedBatch, pack_batch
from vllm_metal.backends.mlx.runner.request_state import RequestStates

BS = 4  # block size of the single-group tests: small, so short prompts cross blocks


class Cached(NamedTuple):
    req_id: str
    num_computed: int
    num_output: int
    new_blocks: tuple[list[int], ...] | None = None
    resumed: bool = False


def new_req(req_id, prompt, blocks, num_computed=0, params=None) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=None if prompt is None else list(prompt),
        mm_features=[],
        sampling_params=params or SamplingParams(temperature=0.0),
        pooling_params=None,
        block_ids=tuple(list(b) for b in blocks),
        num_computed_tokens=num_computed,
        lora_request=None,
    )


def schedule(
    scheduled: dict[str, int], new=(), cached=(), finished=(), drafts=None
) -> SchedulerOutput:
    cached_data = CachedRequestData(
        req_ids=[c.req_id for c in cached],
        resumed_req_ids={c.req_id for c in cached if c.resumed},
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[c.new_blocks for c in cached],
        num_computed_tokens=[c.num_computed for c in cached],
        num_output_tokens=[c.num_output for c in cached],
    )
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached_data,
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens=dict(drafts or {}),
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def step(states: RequestStates, scheduler_output: SchedulerOutput) -> PackedBatch:
    """What the runner does: update the states, then pack the persistent batch."""
    states.update(scheduler_output)
    batch = states.input_batch
    return pack_batch(
        batch.req_ids,
        scheduler_output.num_scheduled_tokens,
        batch.num_computed_tokens_cpu,
        batch.num_tokens_no_spec,
        batch.token_ids_cpu,
        [batch.block_table[g].get_numpy_array() for g in range(len(states.block_sizes))],
        states.block_sizes,
        states.num_draft_tokens(),
    )


def sample(states: RequestStates, tokens: dict[str, int | list[int]]) -> None:
    """Record the sampled token(s) of the named requests (the others' samples are discarded)."""
    rows = []
    for r in states.input_batch.req_ids:
        t = tokens.get(r, [])
        rows.append(list(t) if isinstance(t, list) else [t])
    states.record_sampled(rows)


def span(start: int, n: int) -> list[int]:
    return list(range(start, start + n))
