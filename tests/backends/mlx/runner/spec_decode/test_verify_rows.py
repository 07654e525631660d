"""Verification rows in hand-built schedules: drafts packed after the last sampled token, logits
rows and vLLM's SpecDecodeMetadata for them, -1 placeholders, rejected drafts rolled back, and
the drafts' caps at max_tokens - 1 and max_model_len, and async scheduling's placeholders filled
with the proposed drafts at the positions really computed."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from vllm.sampling_params import SamplingParams

from tests.backends.mlx.runner.schedules import Cached, new_req, sample, schedule, span, step
from vllm_metal.backends.mlx.runner.spec_decode.backoff import _EXPLORE_STEPS, Backoff
from vllm_metal.backends.mlx.runner.spec_decode.verify import spec_decode_metadata


def _two_decoding(states):
    """a (7-token prompt) and b (3-token prompt) prefilled, each with one sampled token."""
    step(
        states,
        schedule(
            {"a": 7, "b": 3},
            new=[new_req("a", span(100, 7), [[5, 2]]), new_req("b", span(200, 3), [[4]])],
        ),
    )
    sample(states, {"a": 500, "b": 600})


def test_drafts_are_query_rows_after_the_last_sampled_token(states):
    _two_decoding(states)
    packed = step(
        states,
        schedule(
            {"a": 3, "b": 1},
            cached=[Cached("a", 7, 1, ([9],)), Cached("b", 3, 1)],
            drafts={"a": [501, 502]},
        ),
    )
    assert_array_equal(packed.token_ids, [500, 501, 502, 600])
    assert_array_equal(packed.positions, [7, 8, 9, 3])
    assert_array_equal(packed.seq_lens, [10, 4])
    # a: position 7 is the last slot of block 2; the drafts go to its new block 9. b: block 4.
    assert_array_equal(packed.slot_mappings[0], [11, 36, 37, 19])
    assert_array_equal(packed.num_draft_tokens, [2, 0])
    # Logits for every row of a (scoring d1, d2, and the bonus), the last row of b.
    assert_array_equal(packed.logits_indices, [0, 1, 2, 3])

    meta = spec_decode_metadata(packed, states.input_batch)
    assert meta.num_draft_tokens == [2, 0]
    assert meta.draft_token_ids.tolist() == [501, 502]
    assert meta.target_logits_indices.tolist() == [0, 1]
    assert meta.bonus_logits_indices.tolist() == [2, 3]
    assert meta.cu_num_draft_tokens.tolist() == [2, 2]
    assert meta.cu_num_sampled_tokens.tolist() == [3, 4]


def test_placeholders_never_reach_the_embedding_and_are_kept_for_rejection(states):
    _two_decoding(states)
    packed = step(
        states,
        schedule(
            {"a": 3, "b": 1}, cached=[Cached("a", 7, 1), Cached("b", 3, 1)], drafts={"a": [-1, -1]}
        ),
    )
    assert_array_equal(packed.token_ids, [500, 0, 0, 600])
    meta = spec_decode_metadata(packed, states.input_batch)
    assert meta.draft_token_ids.tolist() == [-1, -1]


def test_rejected_drafts_are_rolled_back_by_the_next_schedule(states):
    _two_decoding(states)
    step(states, schedule({"a": 3}, cached=[Cached("a", 7, 1)], drafts={"a": [501, 502]}))
    sample(states, {"a": [501, 777]})  # d1 accepted, d2 rejected: 777 recovered
    batch = states.input_batch
    i = batch.req_id_to_index["a"]
    assert batch.num_tokens_no_spec[i] == 10
    assert states.requests["a"].output_token_ids == [500, 501, 777]

    # vLLM computed 7 + 1 + 1 accepted: the next row starts at 777's position, no drafts.
    packed = step(states, schedule({"a": 1}, cached=[Cached("a", 9, 3)]))
    assert_array_equal(packed.token_ids, [777])
    assert_array_equal(packed.positions, [9])
    assert_array_equal(packed.num_draft_tokens, [0])
    assert batch.spec_token_ids[i] == []


def _decoder(vllm_config, backoff=None):
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.spec_decode.decoder import SpecDecoder
    from vllm_metal.backends.mlx.runner.spec_decode.drafter import Drafter

    return SpecDecoder(vllm_config, Sampler(), Drafter(), backoff or Backoff(enabled=False))


def test_caps_stop_one_short_of_max_tokens_and_max_model_len(states, vllm_config):
    max_len = vllm_config.model_config.max_model_len  # 256
    step(
        states,
        schedule(
            {"a": 4, "b": 4, "c": max_len - 2},
            new=[
                new_req("a", span(100, 4), [[1]], params=SamplingParams(max_tokens=3)),
                new_req("b", span(110, 4), [[2]], params=SamplingParams(max_tokens=100)),
                new_req("c", span(1, max_len - 2), [list(range(3, 3 + 64))]),
            ],
        ),
    )
    sampled = [[7], [8], [9]]
    one_each = np.array([1, 1, 1])
    # Decided before the tokens are recorded (`SpecDecoder.plan_ahead`): the same caps.
    ahead = _decoder(vllm_config).caps(states, one_each, unrecorded=one_each)
    states.record_sampled(sampled)
    caps = _decoder(vllm_config).caps(states, one_each)
    assert_array_equal(ahead, caps)
    # a: 1 of 3 tokens out, 2 more at most: one draft + bonus. b: K. c: at max_model_len - 1
    # tokens, one more fits: no draft.
    order = states.input_batch.req_ids
    assert dict(zip(order, caps.tolist())) == {"a": 1, "b": 4, "c": 0}
    # A row with nothing sampled (mid-prefill) never drafts.
    assert _decoder(vllm_config).caps(states, np.array([0, 1, 0])).tolist()[order.index("b")] == 4
    assert _decoder(vllm_config).caps(states, np.array([0, 1, 0])).tolist()[order.index("a")] == 0


def _decode_rows(**fields):
    """The packed batch of a step as the rate bookkeeping reads it: its rows' counts, and
    `decodes_only` as `PackedBatch` works it out from them."""
    from types import SimpleNamespace

    from vllm_metal.backends.mlx.runner.batch import PackedBatch

    packed = SimpleNamespace(**fields)
    packed.decodes_only = PackedBatch.decodes_only.fget(packed)
    return packed


def _timed_step(packed, started, traced=False, spec_caps=None):
    """A step as `SpecDecoder._record_rate` reads it: its packed batch, when it began, whether
    its compiled forward traced, and the caps decided ahead for the step after it."""
    from types import SimpleNamespace

    return SimpleNamespace(packed=packed, started=started, traced=traced, spec_caps=spec_caps)


def test_pipelined_steps_are_timed_between_their_outputs(vllm_config, monkeypatch):
    """Steps carried one ahead start 1 ms apart (each built while the previous one runs) and
    give their outputs 10 ms apart: each is timed 10 ms, not from its own start."""
    from types import SimpleNamespace

    from vllm_metal.backends.mlx.runner.spec_decode import decoder as decoder_module
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    spec = _decoder(vllm_config, backoff)
    clock = iter([0.010, 0.020, 0.030])
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    packed = _decode_rows(
        num_scheduled=np.array([1, 1]), num_draft_tokens=np.array([0, 0]), req_ids=["a", "b"]
    )
    for k in range(3):
        step_k = _timed_step(packed, started=0.001 * k)
        spec._record_rate(step_k, [[7], [8]], verified=False)
    plain = backoff.buckets[batch_bucket(2)].plain
    assert plain.samples == 3 and plain.tokens_per_s == pytest.approx(2 / 0.010)


@pytest.mark.parametrize("began", ["before_the_drafts", "after_a_wait"])
def test_drafting_steps_count_the_drafters_time_once(vllm_config, monkeypatch, began):
    """Outputs 20 ms apart, the drafter taking 4 ms after each. Under async scheduling the next
    step began before the drafts were proposed: it costs 20 ms (the drafting inside, counted
    once). Begun only 10 ms after the drafts (the engine waited): 6 ms of its own plus 4."""
    from types import SimpleNamespace

    from vllm_metal.backends.mlx.runner.spec_decode import decoder as decoder_module
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    spec = _decoder(vllm_config, backoff)
    outputs = [0.020 * (k + 1) for k in range(4)]
    clock = iter(outputs)
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    packed = _decode_rows(
        num_scheduled=np.array([3]), num_draft_tokens=np.array([2]), req_ids=["a"]
    )
    for k, out in enumerate(outputs):
        previous = out - 0.020
        start = previous - 0.001 if began == "before_the_drafts" else previous + 0.014
        step = _timed_step(packed, started=start)
        spec._record_rate(step, [[1, 2, 3]], True)
        spec._drafted = 0.004  # as after_step records its propose
    cost = 0.020 if began == "before_the_drafts" else 0.010
    rate = backoff.buckets[batch_bucket(1)].spec
    assert rate.samples == 4 and rate.tokens_per_s == pytest.approx(3 / cost)


def test_a_step_that_traced_a_compiled_shape_is_not_timed(vllm_config, monkeypatch):
    """Verifying steps 20 ms apart but for one that traced a new compiled shape (500 ms): the
    drafting mode's rate is that of the others, so a trace does not switch drafting off."""
    from types import SimpleNamespace

    from vllm_metal.backends.mlx.runner.spec_decode import decoder as decoder_module
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    spec = _decoder(vllm_config, backoff)
    gaps = [0.020, 0.020, 0.500, 0.020, 0.020]
    outputs = np.cumsum(gaps).tolist()
    clock = iter(outputs)
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    packed = _decode_rows(
        num_scheduled=np.array([3]), num_draft_tokens=np.array([2]), req_ids=["a"]
    )
    for k, gap in enumerate(gaps):
        step = _timed_step(packed, started=outputs[k] - gap, traced=gap > 0.1)
        spec._record_rate(step, [[1, 2, 3]], True)
    rate = backoff.buckets[batch_bucket(1)].spec
    assert rate.samples == 4 and rate.tokens_per_s == pytest.approx(3 / 0.020)


def test_a_plain_step_after_which_drafting_was_decided_is_not_timed(vllm_config, monkeypatch):
    """Plain steps carried one ahead give their outputs 10 ms apart; the last one before drafting
    resumes (decided ahead: `spec_caps`) gives its output 1 ms after the one before, as nothing
    was built while it ran. Plain decoding runs at 100 tokens/s, not at the 143 that timing
    that step would say."""
    from types import SimpleNamespace

    from vllm_metal.backends.mlx.runner.spec_decode import decoder as decoder_module
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    spec = _decoder(vllm_config, backoff)
    outputs = [0.010, 0.020, 0.030, 0.031]
    clock = iter(outputs)
    monkeypatch.setattr(decoder_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    packed = _decode_rows(
        num_scheduled=np.array([1]), num_draft_tokens=np.array([0]), req_ids=["a"]
    )
    for k in range(len(outputs)):
        caps = np.array([3 if k == len(outputs) - 1 else 0], dtype=np.int32)
        step = _timed_step(packed, started=0.001 * k, spec_caps=caps)
        spec._record_rate(step, [[7]], verified=False)
    plain = backoff.buckets[batch_bucket(1)].plain
    assert plain.samples == 3 and plain.tokens_per_s == pytest.approx(100.0)


def test_a_step_read_right_after_the_previous_one_does_not_inflate_its_modes_rate():
    """Two steps read in one drain: one timed 100 ms, the next 8 ms. Their mode runs at one token
    per 54 ms, not at the average of 10 and 125 tokens per second, which would make plain
    decoding look faster than drafting at 3 tokens per 115 ms."""
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    for _ in range(20):
        backoff.record_decode_step(1, 1, 0.100, verified_drafts=False)
        backoff.record_decode_step(1, 1, 0.008, verified_drafts=False)
    for _ in range(20):
        backoff.record_decode_step(1, 3, 0.115, verified_drafts=True)
    plain = backoff.buckets[batch_bucket(1)].plain.tokens_per_s
    assert 1 / 0.075 < plain < 1 / 0.040
    assert backoff.choose(["a"], [2], 1) == [2]


def _measured(spec_rate: float, plain_rate: float, num_decoding: int = 1) -> Backoff:
    backoff = Backoff()
    for verified, rate in ((True, spec_rate), (False, plain_rate)):
        for _ in range(5):
            backoff.record_decode_step(num_decoding, 10, 10 / rate, verified_drafts=verified)
    return backoff


def test_backoff_drafts_until_both_modes_are_measured():
    backoff = Backoff()
    assert backoff.choose(["a"], [4], 1) == [4]  # nothing measured: draft
    for _ in range(3):
        backoff.record_decode_step(1, 10, 1.0, verified_drafts=True)
    assert backoff.choose(["a"], [4], 1) == [0]  # drafting measured: now try without


def test_backoff_keeps_the_faster_mode_per_batch_size_and_retries_the_other():
    backoff = _measured(spec_rate=20.0, plain_rate=10.0, num_decoding=1)
    assert backoff.choose(["a"], [4], 1) == [4]
    slow = _measured(spec_rate=5.0, plain_rate=10.0, num_decoding=16)
    assert slow.choose(["a"], [4], 16) == [0]
    # Batch sizes are measured apart: 16 decoding requests say nothing about 2.
    assert slow.choose(["a"], [4], 2) == [4]
    # The slower mode is tried for five steps after 32 decode steps of a batch size, and
    # after twice as many each time it is still the slower one (each step runs the mode chosen).
    tried = []
    for k in range(32 + 64 + 128 + 16):
        drafts = slow.choose(["a"], [4], 16)[0] > 0
        if drafts:
            tried.append(k)
        slow.record_decode_step(16, 16, 3.2 if drafts else 1.6, verified_drafts=drafts)
    n = _EXPLORE_STEPS
    assert tried == [*range(32, 32 + n), *range(96, 96 + n), *range(224, 224 + n)]
    # Drafting turned faster: it is used, and plain decoding is tried again within 32 steps.
    choices = []
    for _ in range(8 + 33):
        slow.record_decode_step(16, 64, 1.6, verified_drafts=True)
        choices.append(slow.choose(["a"], [4], 16)[0])
    assert choices[-33] == 4 and choices[-33:].count(0) == _EXPLORE_STEPS


def test_the_mode_in_use_stays_until_the_other_leads_it_clearly():
    """Drafting measured at 100 tokens/s against plain decoding's 97 is used; plain decoding
    measured at 103 since (within the noise of steps' timing) does not take over, at 110 it
    does. Every change of mode costs a step that cannot be built one ahead."""
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = _measured(spec_rate=100.0, plain_rate=97.0)
    assert backoff.choose(["a"], [4], 1) == [4]
    bucket = backoff.buckets[batch_bucket(1)]
    for rate, faster_is_spec in ((103.0, True), (110.0, False)):
        for _ in range(64):
            backoff.record_decode_step(1, 10, 10 / rate, verified_drafts=False)
        backoff.choose(["a"], [4], 1)
        assert bucket.faster_is_spec is faster_is_spec


def test_the_first_step_after_a_change_of_mode_is_not_timed():
    """Plain steps of 10 ms, then drafting steps of 3 tokens in 15 ms whose first one paid for
    the change (a head's catch-up pass, a step not built one ahead: 400 ms): drafting runs at
    200 tokens/s, not at the 7.5 tokens/s the first step alone would say."""
    from vllm_metal.backends.mlx.runner.spec_decode.backoff import batch_bucket

    backoff = Backoff()
    for _ in range(6):
        backoff.record_decode_step(1, 1, 0.010, verified_drafts=False)
    for seconds in (0.400, 0.015, 0.015, 0.015):
        backoff.record_decode_step(1, 3, seconds, verified_drafts=True)
    bucket = backoff.buckets[batch_bucket(1)]
    assert bucket.spec.samples == 3 and bucket.spec.tokens_per_s == pytest.approx(200.0)
    assert bucket.plain.tokens_per_s == pytest.approx(100.0)
    assert backoff.choose(["a"], [3], 1) == [3]


def test_a_try_of_the_slower_mode_measures_it_afresh():
    """Drafting's first steps ran while MLX built the kernels of its shapes (3 tokens in 400
    ms), then plain steps were measured at 10 ms a token. The first try of drafting after 32
    plain steps finds 3 tokens in 15 ms (200 tokens/s against 100) and keeps drafting: blended
    with those first steps, drafting would look slower than plain decoding for five more tries
    (about a thousand steps)."""
    backoff = Backoff()
    warm = False
    chosen = []
    for _ in range(48):
        drafts = backoff.choose(["a"], [3], 1)[0] > 0
        chosen.append(drafts)
        if drafts:
            seconds = 0.015 if warm else 0.400
            backoff.record_decode_step(1, 3, seconds, verified_drafts=True)
        else:
            warm = True  # by the next drafting step, its kernels are built
            backoff.record_decode_step(1, 1, 0.010, verified_drafts=False)
    assert chosen[:3] == [True] * 3 and not any(chosen[3:30])
    assert all(chosen[-8:])


def test_backoff_pauses_a_poor_request_for_longer_each_time():
    backoff = Backoff()
    for _ in range(3):
        backoff.record_verification("good", 4, 4)
        backoff.record_verification("poor", 4, 0)
    assert backoff.choose(["good", "poor"], [4, 4], 2) == [4, 0]
    # Left out at step 1 for 4 steps: steps 2-4 it waits, step 5 it is weighed again.
    assert [backoff.choose(["poor"], [4], 2) for _ in range(3)] == [[0]] * 3
    assert backoff.requests["poor"].pause == 8
    assert backoff.choose(["poor"], [4], 2) == [4]  # afresh: it may try again
    backoff.record_verification("poor", 4, 0)  # and is still poor
    assert backoff.choose(["poor"], [4], 2) == [0]
    assert backoff.requests["poor"].pause == 16


def test_backoff_disabled_drafts_every_row_up_to_its_cap():
    backoff = _measured(spec_rate=1.0, plain_rate=10.0, num_decoding=2)
    backoff.enabled = False
    backoff.record_verification("poor", 4, 0)
    assert backoff.choose(["poor", "b"], [4, 2], 2) == [4, 2]


def test_async_placeholders_take_the_proposed_drafts_where_the_tokens_really_are(states):
    """Under async scheduling step N+1 arrives with -1 placeholders and counts step N's drafts as
    accepted: the runner puts in the drafts it proposed after step N, leaves out the placeholders
    it has none for, and starts each row at the tokens it really computed."""
    from vllm_metal.backends.mlx.runner.batch import pack_batch

    _two_decoding(states)
    # Step N: a verifies two drafts; d1 is accepted, d2 rejected (777 recovered).
    step(
        states,
        schedule(
            {"a": 3, "b": 1},
            cached=[Cached("a", 7, 1, ([9],)), Cached("b", 3, 1)],
            drafts={"a": [501, 502]},
        ),
    )
    sample(states, {"a": [501, 777], "b": 601})
    # What `SpecDecoder.after_step` records: a computed 7 + 3 - 1 rejected, b 3 + 1.
    states.computed_after_step.update({"a": 9, "b": 4})

    # Step N+1 as the async scheduler plans it before step N's output reaches it: a at 7 + 3
    # computed (every draft taken as accepted), b at 4; three placeholders each.
    out = schedule(
        {"a": 4, "b": 4},
        cached=[Cached("a", 10, 4), Cached("b", 4, 2, ([6],))],
        drafts={"a": [-1, -1, -1], "b": [-1, -1, -1]},
    )
    states.update(out, {"a": [778, 779], "b": []})
    batch = states.input_batch
    num_scheduled = states.num_scheduled(out)
    packed = pack_batch(
        batch.req_ids,
        num_scheduled,
        batch.num_computed_tokens_cpu,
        batch.num_tokens_no_spec,
        batch.token_ids_cpu,
        [batch.block_table[0].get_numpy_array()],
        states.block_sizes,
        states.num_draft_tokens(),
    )
    assert num_scheduled == {"a": 3, "b": 1}
    assert_array_equal(packed.token_ids, [777, 778, 779, 601])
    assert_array_equal(packed.positions, [9, 10, 11, 4])
    assert_array_equal(packed.num_draft_tokens, [2, 0])
    assert_array_equal(packed.discard, [False, False])
    # b's position 4 opens its new block 6; a's rows stay in block 9.
    assert_array_equal(packed.slot_mappings[0], [37, 38, 39, 24])
    meta = spec_decode_metadata(packed, batch)
    assert meta.draft_token_ids.tolist() == [778, 779]
