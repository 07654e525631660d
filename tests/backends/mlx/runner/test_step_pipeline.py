"""A step's tokens carried on the device into the next step (`step.CarriedTokens`): the next
step's token ids equal those packed after the tokens reached the host, whatever the next
schedule did to the batch (rows reordered, a request added, one finished, a prefill mid-chunk),
and the tokens recorded later land in the right rows; the pipeline samples steps in order; an
engine's grammar, penalized and seeded steps are carried too."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from numpy.testing import assert_array_equal

from tests.backends.mlx.runner.jobs import PERSON_SCHEMA, random_prompts, run_engine_job, tokens
from tests.backends.mlx.runner.schedules import Cached, new_req, schedule, span, step
from vllm_metal.backends.mlx.runner.forward import step_token_ids
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.step import CarriedTokens, StepPipeline

A, B, C, E = span(100, 5), span(200, 6), span(300, 2), span(400, 3)
SAMPLED = {"a": 11, "c": 13, "e": 15}  # b is mid-prefill after the first step: no token


def _first(states: RequestStates):
    return step(
        states,
        schedule(
            {"a": 5, "b": 3, "c": 2, "e": 3},
            new=[
                new_req("a", A, [[1, 2]]),
                new_req("b", B, [[3, 4]]),
                new_req("c", C, [[5]]),
                new_req("e", E, [[6]]),
            ],
        ),
    )


# The next schedule, planned before the first step's tokens are known (async scheduling): a and
# c decode the token the first step drew, b finishes its prompt, d is new, e has finished.
SECOND = schedule(
    {"a": 1, "b": 3, "c": 1, "d": 4},
    new=[new_req("d", span(500, 4), [[7]])],
    cached=[Cached("a", 5, 1), Cached("b", 3, 0), Cached("c", 2, 1)],
    finished=["e"],
)


def _rows(req_ids) -> list[list[int]]:
    return [[SAMPLED[r]] if r in SAMPLED else [] for r in req_ids]


def test_carried_tokens_are_the_ones_the_host_would_have_packed(vllm_config):
    host = RequestStates(vllm_config, [4])
    first = _first(host)
    host.record_sampled(_rows(first.req_ids))
    expected = step(host, SECOND)

    device = RequestStates(vllm_config, [4])
    first = _first(device)
    assert not first.discard[first.req_ids.index("a")] and first.discard[first.req_ids.index("b")]
    drawn = mx.array([SAMPLED.get(r, 999) for r in first.req_ids], dtype=mx.uint32)
    carried = CarriedTokens(first.req_ids, first.seq_lens, ~first.discard, drawn)
    second = carried.into(step(device, SECOND))

    assert second.req_ids == expected.req_ids and second.req_ids != first.req_ids  # reordered
    index, _ = second.carried
    assert sorted(
        second.req_ids[i] for i in np.searchsorted(second.cu_seqlens_q, index, "right") - 1
    ) == ["a", "c"]
    assert_array_equal(np.asarray(step_token_ids(second)), expected.token_ids)
    # A compiled step's padded layout: every token one place on, three zeros around them.
    dest = np.arange(second.num_tokens) + 1
    padded = np.asarray(step_token_ids(second, dest, second.num_tokens + 3))
    assert_array_equal(padded, [0, *expected.token_ids, 0, 0])

    # The first step is sampled after the second was packed: its tokens land by request.
    device.record_sampled(_rows(first.req_ids), first.req_ids)
    for req_id in ("a", "b", "c", "d"):
        i, j = device.input_batch.req_id_to_index[req_id], host.input_batch.req_id_to_index[req_id]
        n = int(host.input_batch.num_tokens_no_spec[j])
        assert int(device.input_batch.num_tokens_no_spec[i]) == n, req_id
        assert_array_equal(
            device.input_batch.token_ids_cpu[i, :n], host.input_batch.token_ids_cpu[j, :n]
        )
        assert device.requests[req_id].output_token_ids == host.requests[req_id].output_token_ids


def test_nothing_carried_into_rows_that_do_not_read_the_token(vllm_config):
    """A row that restarts elsewhere (here: a prefix recomputed from position 0) reads no
    carried token unless its span covers the sampled position."""
    states = RequestStates(vllm_config, [4])
    first = _first(states)
    drawn = mx.array([7] * len(first.req_ids), dtype=mx.uint32)
    carried = CarriedTokens(first.req_ids, first.seq_lens + 10, ~first.discard, drawn)
    second = carried.into(step(states, SECOND))
    assert second.carried is None
    assert_array_equal(np.asarray(step_token_ids(second)), second.token_ids)


class _Step:
    def __init__(self, name):
        self.name, self.output, self.carried = name, None, False


def test_the_pipeline_samples_in_order_and_carries_only_the_newest():
    order = []
    pipeline = StepPipeline(lambda s: order.append(s.name) or s.name, async_scheduling=True)
    for name in ("n", "n+1"):
        pipeline.executed = _Step(name)
        pipeline.hand_out(None)
    # `carries` weighs the newest step once every earlier one is sampled.
    newest = pipeline.drain(lambda s: order == ["n"])
    assert newest.name == "n+1" and newest.carried and order == ["n"]
    assert pipeline.carried_steps == 1
    pipeline.executed = _Step("n+2")
    later = pipeline.hand_out(None)
    assert later.get_output() == "n+2" and order == ["n", "n+1", "n+2"]  # in step order
    assert pipeline.drain(lambda s: True) is None  # nothing left pending


# ------------------------------------------------------------------------------ the engine

STRUCTURED = [
    {"regex": "[a-c]{3}-[0-9]{2}"},
    {"json": PERSON_SCHEMA},
    {"choice": ["yes", "no", "maybe"]},
]


@pytest.mark.slow
def test_grammar_steps_carried_on_the_device_give_the_tokens_of_sampling_first(tiny_model_dir):
    """Structured outputs under async scheduling: each step's grammar rows are drawn again over
    their masked logits on the device and handed to the next step there; greedy tokens equal an
    engine's that samples every step on the host first (async scheduling off), and obey their
    grammars."""
    import jsonschema

    model = tiny_model_dir("qwen3")
    prompts = random_prompts(21, [5, 9, 13])
    jobs = [
        {
            "prompts": prompts,
            "params": [
                {"max_tokens": 40, "temperature": 0.0, "structured_outputs": s} for s in STRUCTURED
            ],
        },
        {"action": "carried_steps"},
    ]
    engine = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = {
        mode: run_engine_job(model, jobs, engine={**engine, "async_scheduling": mode}, env=env)
        for mode in (True, False)
    }
    (carried_batch, carried), (host_batch, _) = runs[True], runs[False]
    assert carried > 10, carried
    assert tokens(carried_batch) == tokens(host_batch)
    regex, as_json, choice = (r["outputs"][0]["text"] for r in carried_batch)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", regex), regex
    jsonschema.validate(json.loads(as_json), PERSON_SCHEMA)
    assert choice in STRUCTURED[2]["choice"], choice


@pytest.mark.slow
def test_penalized_steps_carried_on_the_device_count_the_tokens_still_there(tiny_model_dir):
    """Presence, frequency and repetition penalties under async scheduling: a step's tokens go
    into the next step on the device and the next step's penalties count them there (the host's
    lists lack them yet); greedy tokens equal an engine's that samples every step on the host
    first (async scheduling off), requests finishing at their own lengths beside one without
    penalties, and min tokens: a request that may stop on almost any token stops on the step
    after its minimum, counting the token carried in (without it, one step later). Small
    weights make the model repeat its last token, which only a count of the token carried in
    can stop."""
    model = tiny_model_dir("qwen3", weight_std=0.02)
    almost_any = [t for t in range(768) if t not in range(700, 705)]
    penalties = [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8},
        {"repetition_penalty": 1.6},
        {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.2},
        {},
        {"min_tokens": 9, "stop_token_ids": almost_any},
    ]
    jobs = [
        {
            "prompts": random_prompts(33, [6, 11, 4, 9, 7, 5]),
            "params": [
                {"max_tokens": 24 + 6 * i, "temperature": 0.0, "ignore_eos": True, **p}
                for i, p in enumerate(penalties)
            ],
        },
        {"action": "carried_steps"},
    ]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = {
        mode: run_engine_job(model, jobs, engine={"async_scheduling": mode}, env=env)
        for mode in (True, False)
    }
    (carried_batch, carried), (host_batch, _) = runs[True], runs[False]
    assert carried > 20, carried
    assert tokens(carried_batch) == tokens(host_batch)
    stopped = tokens(carried_batch)[-1]
    assert len(stopped) == 10 and stopped[-1] in almost_any, stopped


def test_seeded_steps_carried_on_the_device_draw_what_vllms_sampler_draws(tiny_model_dir):
    """Seeded sampled requests (top-k, top-p, min-p, a presence penalty with logprobs) beside a
    greedy one under async scheduling: each step's seeded rows are drawn on the device with the
    noise of their generators keyed to the position, and the step goes into the next one there.
    Their tokens equal an engine's whose every step goes to vLLM's `Sampler` on the host (a
    custom logits processor that changes nothing, async scheduling off), and differ by seed."""
    model = tiny_model_dir("qwen3")
    sampled = [
        {"temperature": 0.9, "top_k": 40, "seed": 1},
        {"temperature": 1.2, "top_p": 0.8, "min_p": 0.02, "seed": 2},
        {"temperature": 0.8, "presence_penalty": 0.6, "logprobs": 2, "seed": 3},
        {"temperature": 0.8, "presence_penalty": 0.6, "logprobs": 2, "seed": 4},
        {"temperature": 0.0},
    ]
    jobs = [
        {
            "prompts": random_prompts(41, [7, 12, 5, 9]),
            "params": [
                {"max_tokens": 24 + 4 * i, "ignore_eos": True, **p} for i, p in enumerate(sampled)
            ],
        },
        {"action": "carried_steps"},
    ]
    jobs[0]["prompts"].insert(3, jobs[0]["prompts"][2])  # the third prompt, seeded otherwise
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    host_engine = {
        "async_scheduling": False,
        "logits_processors": ["tests.fixtures.identity_logits_processor:Identity"],
    }
    carried_batch, carried = run_engine_job(model, jobs, engine={"async_scheduling": True}, env=env)
    host_batch, host_carried = run_engine_job(model, jobs, engine=host_engine, env=env)
    assert carried > 20 and host_carried == 0, (carried, host_carried)
    assert tokens(carried_batch) == tokens(host_batch)
    seeded_3, seeded_4 = tokens(carried_batch)[2:4]
    assert seeded_3[:24] != seeded_4  # same prompt and settings, other seeds
