"""Sampling with vLLM's own `Sampler` (grammar bitmask included), or its `RejectionSampler` on a
step that verifies drafts (`spec_decode/verify.py`); token write-back into the request state,
and the step's `ModelRunnerOutput`."""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler

from vllm_metal.backends.mlx.runner.prompt_logprobs import gather_prompt_logprobs
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.step import StepState
from vllm_metal.backends.mlx.runner.tensors import to_torch


def sample_step(
    step: StepState,
    states: RequestStates,
    sampler: Sampler,
    logprobs_mode: str,
    rejection_sampler: RejectionSampler | None = None,
) -> ModelRunnerOutput:
    batch = states.input_batch
    logits = to_torch(step.logits)  # waits for the forward
    if step.grammar_output is not None:
        from vllm.v1.structured_output.utils import apply_grammar_bitmask

        apply_grammar_bitmask(step.scheduler_output, step.grammar_output, batch, logits)

    # The sampler draws random numbers for rows mid-prefill too, whose token is dropped; their
    # seeded generators are put back so the request sees the stream of vLLM's other backends.
    saved = _generator_states(batch, step.packed.discard)
    if step.packed.num_draft_tokens.any():
        assert rejection_sampler is not None, "drafts scheduled without speculative decoding"
        from vllm_metal.backends.mlx.runner.spec_decode.verify import verify

        sampled, logprobs = verify(rejection_sampler, logits, step.packed, batch, states.vocab_size)
    else:
        sampled, logprobs = _sample(sampler, logits, batch, step.packed.discard)
    for i, state in saved.items():
        batch.generators[i].set_state(state)
    states.record_sampled(sampled)

    return ModelRunnerOutput(
        req_ids=batch.req_ids.copy(),
        req_id_to_index=batch.req_id_to_index.copy(),
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs_dict=gather_prompt_logprobs(
            states, step.packed, step.prompt_logits, sampler, logprobs_mode
        ),
    )


def _sample(sampler: Sampler, logits, batch, discard: np.ndarray):
    sampler_output = sampler(logits=logits, sampling_metadata=batch.sampling_metadata)
    sampled = sampler_output.sampled_token_ids.tolist()
    for i in np.nonzero(discard)[0]:
        sampled[int(i)] = []

    logprobs = None
    if sampler_output.logprobs_tensors is not None:
        logprobs = sampler_output.logprobs_tensors.tolists()
    return sampled, logprobs


def _generator_states(batch, discard: np.ndarray) -> dict[int, torch.Tensor]:
    return {
        int(i): batch.generators[int(i)].get_state()
        for i in np.nonzero(discard)[0]
        if int(i) in batch.generators
    }
