"""A step whose rows all sample greedily takes the argmax computed on the device, token-identical
to vLLM's host `Sampler` on the same logits and without copying them; anything that moves the
argmax (a logit bias, min tokens, a seeded random row) keeps the host sampler."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import Sampler

from tests.backends.mlx.runner.schedules import BS, new_req, schedule, span, step
from vllm_metal.backends.mlx.runner import sample
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.step import StepState

VOCAB = 64  # logits columns used (the rest of the tiny model's vocabulary is -inf)


def _run(vllm_config, params: dict[str, SamplingParams], on_device: bool, monkeypatch):
    """One step of requests a (decode-sized prompt, sampled), b (mid-prefill: discarded) and c,
    sampled from fixed logits; returns (sampled ids, whether the logits went to the host)."""
    states = RequestStates(vllm_config, [BS])
    sched = schedule(
        {"a": 3, "b": 2, "c": 4},
        new=[
            new_req("a", span(10, 3), [[1]], params=params.get("a")),
            new_req("b", span(20, 6), [[2, 3]], params=params.get("b")),
            new_req("c", span(30, 4), [[4]], params=params.get("c")),
        ],
    )
    packed = step(states, sched)
    rng = np.random.default_rng(0)
    vocab = states.vocab_size
    table = np.full((3, vocab), -np.inf, np.float32)
    table[:, :VOCAB] = rng.standard_normal((3, VOCAB))
    logits = mx.array(table)
    greedy = mx.argmax(logits, axis=-1) if on_device else None
    copied = []
    real = sample.to_torch
    monkeypatch.setattr(sample, "to_torch", lambda a: copied.append(a) or real(a))
    state = StepState(sched, packed, logits, {}, greedy=greedy)
    output = sample.sample_step(state, states, Sampler(), "raw_logprobs")
    by_req = dict(zip(output.req_ids, output.sampled_token_ids))
    return by_req, bool(copied)


def test_greedy_rows_sample_on_the_device_like_the_host_sampler(vllm_config, monkeypatch):
    greedy = {r: SamplingParams(temperature=0.0) for r in "abc"}
    device, copied = _run(vllm_config, greedy, True, monkeypatch)
    host, host_copied = _run(vllm_config, greedy, False, monkeypatch)
    assert not copied and host_copied
    assert device == host
    assert device["b"] == [] and len(device["a"]) == len(device["c"]) == 1


@pytest.mark.parametrize(
    "odd",
    [
        SamplingParams(temperature=0.0, logit_bias={5: 50.0}),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[7]),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, seed=3),
    ],
    ids=["logit_bias", "min_tokens", "logprobs", "seeded"],
)
def test_rows_that_move_the_argmax_keep_the_host_sampler(vllm_config, monkeypatch, odd):
    params = {"a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.0), "c": odd}
    device, copied = _run(vllm_config, params, True, monkeypatch)
    host, _ = _run(vllm_config, params, False, monkeypatch)
    assert copied, "the host sampler must run"
    assert device == host
    if odd.logit_bias:
        assert device["c"] == [5]
