"""Steps verifying drafts in hand-built schedules, and their outputs by the device's verdicts
and by vLLM's own `RejectionSampler` over the same logits."""

from __future__ import annotations

import numpy as np

from tests.backends.mlx.runner.schedules import Cached, new_req, sample, schedule, span, step
from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.spec_decode import verify


def three_verifying(states, params=None, drafts=None, new=()):
    """a (three drafts), b (two, the second a placeholder) and c (none) verifying after their
    prompts, sampled with `params` (req_id -> SamplingParams; greedy without), beside the whole
    prompts of `new` (`NewRequestData`, arriving in that step). a's output so far is [500], b's
    [600], c's [700]."""
    params = params or {}
    step(
        states,
        schedule(
            {"a": 7, "b": 3, "c": 4},
            new=[
                new_req(r, span(base, n), [[block]], params=params.get(r))
                for r, base, n, block in (("a", 100, 7, 5), ("b", 200, 3, 4), ("c", 300, 4, 6))
            ],
        ),
    )
    sample(states, {"a": 500, "b": 600, "c": 700})
    drafts = drafts or {"a": [501, 502, 503], "b": [601, -1]}
    scheduled = {r: 1 + len(drafts.get(r, [])) for r in "abc"}
    scheduled.update({n.req_id: len(n.prompt_token_ids) for n in new})
    cached = [Cached("a", 7, 1, ([9],)), Cached("b", 3, 1), Cached("c", 4, 1, ([10],))]
    return step(states, schedule(scheduled, new=new, cached=cached, drafts=drafts)), drafts


def device_outputs(states, packed, logits: np.ndarray, key: int, logprobs_mode=None, keyed=True):
    """The outputs the device's verdicts give, seeded requests' drawn by position there with
    their noise (`seeded.keyed_noise`, as `Sampling.finish_step` draws them), or with
    `keyed=False` on the host (as a step whose drafts came from the device is sampled); with
    `logprobs_mode`, (outputs, logprobs)."""
    import mlx.core as mx
    from vllm.v1.sample.sampler import Sampler

    noise = seeded.keyed_noise(states, packed, logits.shape[-1]) if keyed else None
    logits = mx.array(logits)
    batch = states.input_batch
    tokens, accepts, processed = verify.device_verdicts(
        logits, packed, batch, mx.random.key(key), noise
    )
    logprobs, values = verify.verdict_logprobs(
        logits, tokens, processed, batch.sampling_metadata, logprobs_mode or "raw_logprobs"
    )
    sampler = Sampler(logprobs_mode=logprobs_mode or "raw_logprobs")
    out, lists = verify.verdict_outputs(
        (tokens, accepts), logprobs, values, logits, packed, states, sampler, noise is not None
    )
    return out if logprobs_mode is None else (out, lists)


def vllm_outputs(states, packed, logits: np.ndarray, logprobs_mode: str = "raw_logprobs"):
    """(outputs, logprobs) of vLLM's `RejectionSampler` over the same logits."""
    import torch
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.spec_decode.kernels import register_rejection_kernels

    register_rejection_kernels()  # as the engine does at start-up
    sampler = RejectionSampler(Sampler(logprobs_mode=logprobs_mode))
    seeded.reseed(states)  # as a step sampled on the host is
    return verify.verify(sampler, torch.from_numpy(logits), packed, states)
