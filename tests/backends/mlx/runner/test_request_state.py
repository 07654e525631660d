"""`RequestStates.update` keeps per-request state and vLLM's persistent `InputBatch` in step with
hand-built vLLM schedules: new, continuing, paused, preempted/resumed, finished and streaming
requests, dropped output tokens, decode-first order and prompt-logprob bookkeeping."""

from __future__ import annotations

import pytest
from numpy.testing import assert_array_equal
from vllm.sampling_params import SamplingParams

from tests.backends.mlx.runner.schedules import Cached, new_req, sample, schedule, span, step
from vllm_metal.backends.mlx.runner.request_state import RequestStates


def row(states: RequestStates, req_id: str) -> dict:
    """The persistent batch's view of one request."""
    batch = states.input_batch
    i = batch.req_id_to_index[req_id]
    n = int(batch.num_tokens_no_spec[i])
    table = batch.block_table[0]
    return {
        "tokens": batch.token_ids_cpu[i, :n].tolist(),
        "num_prompt": int(batch.num_prompt_tokens[i]),
        "num_computed": int(batch.num_computed_tokens_cpu[i]),
        "blocks": table.get_numpy_array()[i, : table.num_blocks_per_row[i]].tolist(),
    }


def test_new_requests_enter_the_batch_with_their_prompt_and_blocks(states):
    seeded = SamplingParams(temperature=1.0, seed=7)
    states.update(
        schedule(
            {"a": 5, "b": 2},
            new=[
                new_req("a", span(100, 5), [[3, 8]], params=seeded),
                new_req("b", span(200, 6), [[1, 2]], 4),
            ],
        )
    )
    batch = states.input_batch
    assert batch.req_ids == ["b", "a"]  # a chunk with cached context before a first chunk
    assert row(states, "a") == {
        "tokens": span(100, 5),
        "num_prompt": 5,
        "num_computed": 0,
        "blocks": [3, 8],
    }
    assert row(states, "b") == {
        "tokens": span(200, 6),
        "num_prompt": 6,
        "num_computed": 4,
        "blocks": [1, 2],
    }
    assert states.requests["a"].block_ids == ([3, 8],)
    assert states.requests["b"].num_computed_tokens == 4
    assert states.requests["a"].output_token_ids == []
    # only the seeded request gets its own generator, seeded as asked
    assert batch.generators.keys() == {1}
    assert batch.generators[1].initial_seed() == 7
    assert states.num_prompt_logprobs == {}


def test_prompt_embeddings_are_refused_naming_the_request(states):
    with pytest.raises(ValueError, match="request e"):
        states.update(schedule({"e": 3}, new=[new_req("e", None, [[1]])]))


def test_record_sampled_appends_to_the_batch_and_the_request(states):
    states.update(
        schedule(
            {"a": 3, "b": 2},
            new=[new_req("a", span(100, 3), [[1]]), new_req("b", span(200, 4), [[2]])],
        )
    )
    states.record_sampled([[500], []])  # b is mid-prefill: nothing to record
    assert row(states, "a")["tokens"] == [100, 101, 102, 500]
    assert row(states, "b")["tokens"] == span(200, 4)
    assert states.requests["a"].output_token_ids == [500]
    assert states.requests["b"].output_token_ids == []
    states.record_sampled([[501, 502], [600]])
    assert row(states, "a")["tokens"] == [100, 101, 102, 500, 501, 502]
    assert row(states, "b")["tokens"] == span(200, 4) + [600]
    assert states.requests["a"].output_token_ids == [500, 501, 502]


def test_continuing_request_appends_new_blocks_in_state_and_batch(states):
    step(states, schedule({"a": 4}, new=[new_req("a", span(100, 4), [[5]])]))
    sample(states, {"a": 500})
    step(states, schedule({"a": 1}, cached=[Cached("a", 4, 1, ([9],))]))
    assert states.requests["a"].block_ids == ([5, 9],)
    assert states.requests["a"].num_computed_tokens == 4
    assert row(states, "a") == {
        "tokens": span(100, 4) + [500],
        "num_prompt": 4,
        "num_computed": 4,
        "blocks": [5, 9],
    }


def test_paused_request_leaves_the_batch_and_returns_where_it_stopped(states):
    new = [new_req("a", span(100, 4), [[1]]), new_req("b", span(200, 4), [[2]])]
    step(states, schedule({"a": 4, "b": 4}, new=new))
    sample(states, {"a": 500, "b": 600})

    packed = step(states, schedule({"b": 1}, cached=[Cached("b", 4, 1, ([3],))]))
    assert packed.req_ids == ["b"] == states.input_batch.req_ids
    assert states.requests["a"].output_token_ids == [500]  # state kept
    sample(states, {"b": 601})

    packed = step(
        states, schedule({"a": 1, "b": 1}, cached=[Cached("a", 4, 1, ([5],)), Cached("b", 5, 2)])
    )
    assert sorted(packed.req_ids) == ["a", "b"]
    assert row(states, "a") == {
        "tokens": span(100, 4) + [500],
        "num_prompt": 4,
        "num_computed": 4,
        "blocks": [1, 5],
    }
    i = packed.req_ids.index("a")
    assert packed.token_ids[packed.cu_seqlens_q[i]] == 500
    assert packed.slot_mappings[0][packed.cu_seqlens_q[i]] == 20  # block 5, position 4


def test_preempted_request_keeps_its_outputs_and_resumes_in_replacement_blocks(states):
    step(states, schedule({"a": 5}, new=[new_req("a", span(100, 5), [[1, 2]])]))
    sample(states, {"a": 500})
    step(states, schedule({"a": 1}, cached=[Cached("a", 5, 1)]))
    sample(states, {"a": 501})

    states.update(schedule({}))  # preempted: nothing scheduled
    assert states.input_batch.req_ids == []
    assert states.requests["a"].output_token_ids == [500, 501]

    step(states, schedule({"a": 7}, cached=[Cached("a", 0, 2, ([7, 4],), resumed=True)]))
    assert states.requests["a"].block_ids == ([7, 4],)  # replaced, not appended
    assert row(states, "a") == {
        "tokens": span(100, 5) + [500, 501],
        "num_prompt": 5,
        "num_computed": 0,
        "blocks": [7, 4],
    }


def test_request_preempted_and_resumed_between_two_steps_is_rebuilt(states):
    # vLLM's reset_prefix_cache preempts running requests and may resume them in the very next
    # step, so the runner never sees them unscheduled.
    step(states, schedule({"a": 5}, new=[new_req("a", span(100, 5), [[1, 2]])]))
    sample(states, {"a": 500})
    packed = step(states, schedule({"a": 6}, cached=[Cached("a", 0, 1, ([7, 4],), True)]))
    assert states.requests["a"].block_ids == ([7, 4],)
    assert row(states, "a") == {
        "tokens": span(100, 5) + [500],
        "num_prompt": 5,
        "num_computed": 0,
        "blocks": [7, 4],
    }
    assert_array_equal(packed.positions, span(0, 6))
    assert_array_equal(packed.slot_mappings[0], [28, 29, 30, 31, 16, 17])


def test_finished_requests_leave_state_and_batch(states):
    logprobs = SamplingParams(temperature=0.0, prompt_logprobs=1)
    new = [
        new_req("a", span(100, 4), [[1]]),
        new_req("b", span(200, 4), [[2]], params=logprobs),
        new_req("c", span(300, 4), [[3]]),
    ]
    step(states, schedule({"a": 4, "b": 2, "c": 4}, new=new))
    sample(states, {"a": 500, "c": 700})
    step(states, schedule({"a": 1, "b": 2}, cached=[Cached("a", 4, 1), Cached("b", 2, 0)]))
    sample(states, {"a": 501, "b": 600})
    assert "c" in states.requests  # paused, then finished while out of the batch
    states.update(schedule({"a": 1}, cached=[Cached("a", 5, 2)], finished={"b", "c"}))
    assert states.requests.keys() == {"a"}
    assert states.input_batch.req_ids == ["a"]
    assert states.num_prompt_logprobs == {}
    assert row(states, "a")["tokens"] == span(100, 4) + [500, 501]


def test_dropped_output_tokens_are_forgotten_in_the_batch(states):
    step(states, schedule({"a": 4}, new=[new_req("a", span(100, 4), [[1, 2]])]))
    sample(states, {"a": 500})
    step(states, schedule({"a": 1}, cached=[Cached("a", 4, 1)]))
    sample(states, {"a": 501})
    step(states, schedule({"a": 1}, cached=[Cached("a", 5, 2)]))
    sample(states, {"a": 502})

    # The scheduler kept two outputs: 501 (position 5) is the next input, 502 is gone.
    packed = step(states, schedule({"a": 1}, cached=[Cached("a", 5, 2)]))
    assert states.requests["a"].output_token_ids == [500, 501]
    assert row(states, "a")["tokens"] == span(100, 4) + [500, 501]
    assert_array_equal(packed.token_ids, [501])
    assert_array_equal(packed.positions, [5])
    assert_array_equal(packed.discard, [False])  # the context is complete: keep the sample
    sample(states, {"a": 503})
    assert row(states, "a")["tokens"] == span(100, 4) + [500, 501, 503]


def test_dropped_output_tokens_of_a_request_out_of_the_batch(states):
    step(states, schedule({"a": 4}, new=[new_req("a", span(100, 4), [[1, 2]])]))
    sample(states, {"a": 500})
    step(states, schedule({"a": 1}, cached=[Cached("a", 4, 1)]))
    sample(states, {"a": 501})
    states.update(schedule({}))  # paused
    step(states, schedule({"a": 1}, cached=[Cached("a", 4, 1)]))
    assert states.requests["a"].output_token_ids == [500]
    assert row(states, "a")["tokens"] == span(100, 4) + [500]


def test_batch_orders_decodes_before_prefill_chunks(states):
    new = [new_req("c", span(300, 6), [[4, 5]]), new_req("a", span(100, 4), [[1]])]
    step(states, schedule({"c": 3, "a": 4}, new=new))
    assert states.input_batch.req_ids == ["c", "a"]  # both first chunks: arrival order
    sample(states, {"a": 500})

    step(
        states,
        schedule(
            {"c": 3, "a": 1, "b": 5},
            new=[new_req("b", span(200, 10), [[2, 3]])],
            cached=[Cached("c", 3, 0), Cached("a", 4, 1, ([6],))],
        ),
    )
    assert states.input_batch.req_ids == ["a", "c", "b"]
    # every per-row array moved with its request
    assert row(states, "a") == {
        "tokens": span(100, 4) + [500],
        "num_prompt": 4,
        "num_computed": 4,
        "blocks": [1, 6],
    }
    assert row(states, "c") == {
        "tokens": span(300, 6),
        "num_prompt": 6,
        "num_computed": 3,
        "blocks": [4, 5],
    }
    assert row(states, "b") == {
        "tokens": span(200, 10),
        "num_prompt": 10,
        "num_computed": 0,
        "blocks": [2, 3],
    }
    assert states.input_batch.req_output_token_ids[0] == [500]


def test_streaming_session_continues_with_the_extended_prompt(states):
    step(states, schedule({"s": 5}, new=[new_req("s", span(100, 5), [[1, 2]])]))
    sample(states, {"s": 500})
    step(states, schedule({"s": 1}, cached=[Cached("s", 5, 1)]))
    sample(states, {"s": 501})

    # The next input was already queued: the session comes back while still in the batch.
    # vLLM keeps the computed output (500), drops the last sample (501), appends the input.
    prompt = span(100, 5) + [500, 900, 901, 902]
    packed = step(states, schedule({"s": 3}, new=[new_req("s", prompt, [[1, 2, 3]], 6)]))
    assert states.requests["s"].output_token_ids == []
    assert states.input_batch.req_ids == ["s"]
    assert row(states, "s") == {
        "tokens": prompt,
        "num_prompt": 9,
        "num_computed": 6,
        "blocks": [1, 2, 3],
    }
    assert_array_equal(packed.token_ids, [900, 901, 902])
    assert_array_equal(packed.positions, [6, 7, 8])
    assert_array_equal(packed.slot_mappings[0], [10, 11, 12])


def test_prompt_logprob_counts_are_kept_per_request(states):
    new = [
        new_req(
            "k", span(100, 4), [[1]], params=SamplingParams(temperature=0.0, prompt_logprobs=3)
        ),
        new_req(
            "all", span(200, 4), [[2]], params=SamplingParams(temperature=0.0, prompt_logprobs=-1)
        ),
        new_req("none", span(300, 4), [[3]]),
    ]
    states.update(schedule({"k": 4, "all": 4, "none": 4}, new=new))
    assert states.num_prompt_logprobs == {"k": 3, "all": states.vocab_size}
    assert states.vocab_size == 768  # the tiny checkpoint's vocabulary


def test_a_seeded_streaming_session_continues_its_random_stream(states):
    import torch

    params = SamplingParams(temperature=1.0, seed=7)
    step(states, schedule({"s": 5}, new=[new_req("s", span(100, 5), [[1, 2]], params=params)]))
    first_turn = states.input_batch.generators[0]
    torch.rand(3, generator=first_turn)  # the first turn samples

    prompt = span(100, 5) + [500, 900]
    step(states, schedule({"s": 1}, new=[new_req("s", prompt, [[1, 2]], 6, params=params)]))
    generator = states.input_batch.generators[0]
    assert generator is first_turn
    replay = torch.Generator().manual_seed(7)
    assert not torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=replay))
