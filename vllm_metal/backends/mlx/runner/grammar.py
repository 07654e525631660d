"""A structured-output grammar's bitmask on a step (vLLM's `GrammarOutput`, known when the step is
sampled): its rows' tokens drawn again over the masked logits on the device, and the bitmask laid
out for the drafts the step verifies where it goes to vLLM's samplers on the host."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np

from vllm_metal.backends.mlx.runner.device_sampling import (
    grammar_masked,
    logprob_values,
    step_logprobs,
)

if TYPE_CHECKING:
    from vllm_metal.backends.mlx.runner.device_sampling import DeviceSampler
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState


def redraw_grammar_rows(
    step: StepState, states: RequestStates, device: DeviceSampler, logprobs_mode: str
) -> None:
    """The step's device tokens (and logprobs) drawn again over its logits with the grammars'
    bitmasks applied on the device (`device_sampling.grammar_masked`), as vLLM applies them
    before its `Sampler`: logprobs are those of the masked logits. vLLM lays a request's
    bitmask out over the drafts it scheduled; the step verifies none, so each request keeps
    the first of its rows (`grammar_for_step_drafts`)."""
    batch = states.input_batch
    _, grammar = grammar_for_step_drafts(step, batch)
    index = {req_id: i for i, req_id in enumerate(step.packed.req_ids)}
    kept = [j for j, r in enumerate(grammar.structured_output_request_ids) if r in index]
    rows = np.array([index[grammar.structured_output_request_ids[j]] for j in kept], np.int64)
    masked = grammar_masked(step.logits, rows, grammar.grammar_bitmask[kept])
    draw = device.draw(masked, batch, keyed=step.keyed)
    assert draw is not None, "the device drew the step's tokens before its grammar"
    step.device_tokens = draw.tokens
    if step.device_logprobs is not None:
        step.logprob_values = logprob_values(masked, draw, logprobs_mode)
        step.device_logprobs = step_logprobs(
            step.logprob_values, draw.tokens, batch.sampling_metadata
        )


def grammar_for_step_drafts(step: StepState, batch) -> tuple:
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
