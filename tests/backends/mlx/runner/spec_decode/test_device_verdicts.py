"""The device's verdicts on steps verifying drafts (`spec_decode.verify.device_verdicts`):
greedy rows, and rows with penalties, allowed tokens, bad words, a minimum length or top
logprobs, give vLLM's `RejectionSampler`'s tokens and logprobs over the same logits; sampled
rows keep the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from vllm.sampling_params import SamplingParams

from tests.backends.mlx.runner.schedules import BS, new_req, span
from tests.backends.mlx.runner.spec_decode.verifying import (
    device_outputs,
    three_verifying,
    vllm_outputs,
)
from vllm_metal.backends.mlx.runner.spec_decode import verify


@pytest.mark.parametrize("seed", range(6))
def test_greedy_drafts_verified_on_the_device_as_by_vllms_rejection_sampler(states, seed):
    """Greedy rows whose argmax match their drafts or not at random: the device's verdicts
    give the tokens vLLM's `RejectionSampler` gives over the same logits."""
    packed, drafts = three_verifying(states)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    rows = {"a": [0, 1, 2, 3], "b": [4, 5, 6], "c": [7]}
    for req_id, req_rows in rows.items():
        proposed = drafts.get(req_id, [])
        for j, row in enumerate(req_rows):
            # Each draft the argmax with probability 3/4; else (and for the bonus) another.
            hit = j < len(proposed) and proposed[j] >= 0 and rng.random() < 0.75
            logits[row, proposed[j] if hit else int(rng.integers(1, 99))] = 20.0
    assert verify.verifies_on_device(states)
    got = device_outputs(states, packed, logits, seed)
    want, _ = vllm_outputs(states, packed, logits)
    assert got == want
    assert [len(t) for t in got] != [1, 1, 1] or seed > 2  # some drafts are accepted


def test_sampled_drafts_verified_on_the_device_keep_the_targets_distribution(states):
    """Sampled rows (temperature 0.8, top-k 4) beside a greedy one: a's first token follows its
    first row's distribution whether the draft is accepted or not, its second (after the draft
    was accepted) its second row's, and c's (no drafts) its bonus row's: chi-square tests
    against draws from those distributions; the greedy row verifies as ever. Accepting every
    draft, or none, fails them."""
    from tests.backends.mlx.runner.stats import chi2_pvalue

    sampled = SamplingParams(temperature=0.8, top_k=4)
    packed, _ = three_verifying(states, {"a": sampled, "c": sampled})
    assert verify.verifies_on_device(states)
    logits = np.full((packed.num_tokens, states.vocab_size), -10.0, dtype=np.float32)
    kept = {  # row -> {token: logit}; each row's top 4, the draft it scores among them
        0: {501: 1.5, 10: 2.0, 11: 1.0, 12: 0.3},
        1: {502: 0.2, 20: 1.0, 21: 0.5, 22: -0.5},
        2: {503: 3.0, 30: 0.0, 31: 0.0, 32: 0.0},
        3: {40: 0.0, 41: 0.5, 42: 1.0, 43: -1.0},
        7: {70: 0.0, 71: 0.5, 72: 1.0, 73: -1.0},
    }
    for row, values in kept.items():
        logits[row, list(values)] = list(values.values())
    logits[4, 601], logits[5, 55] = 5.0, 5.0  # b: accepts 601, then 55

    def draws(row: int, n: int, rng) -> list[int]:
        tokens = np.array(list(kept[row]))
        p = np.exp(np.array(list(kept[row].values())) / 0.8)
        return rng.choice(tokens, size=n, p=p / p.sum()).tolist()

    n = 1500
    outs = [device_outputs(states, packed, logits, key) for key in range(n)]
    assert all(o[1] == [601, 55] for o in outs)
    first = [o[0][0] for o in outs]
    second = [o[0][1] for o in outs if o[0][0] == 501]
    rng = np.random.default_rng(0)
    assert chi2_pvalue(first, draws(0, n, rng)) > 1e-3
    assert chi2_pvalue(second, draws(1, len(second), rng)) > 1e-3
    assert chi2_pvalue([o[2][0] for o in outs], draws(7, n, rng)) > 1e-3


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
def test_logprobs_of_device_verification_are_vllms(states, mode):
    """Top-3 logprobs asked by a (greedy, drafts accepted then one rejected), b (greedy) and c
    (temperature 0.8 and top-k 4 over a row whose top token is certain): the device's token
    ids, values and ranks of every token output, and their split by request, equal those of
    vLLM's `RejectionSampler` over the same logits in each logprobs mode."""
    greedy = SamplingParams(temperature=0.0, logprobs=3)
    hot = SamplingParams(temperature=0.8, top_k=4, logprobs=3)
    packed, _ = three_verifying(states, {"a": greedy, "b": greedy, "c": hot})
    assert verify.verifies_on_device(states)
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    for row, token in ((0, 501), (1, 502), (2, 40), (4, 601), (5, 55), (7, 70)):
        logits[row, token] = 30.0 if row == 7 else 6.0  # a: 501, 502 accepted, 503 not
    got, got_logprobs = device_outputs(states, packed, logits, 0, mode)
    want, want_logprobs = vllm_outputs(states, packed, logits, mode)
    assert got == want == [[501, 502, 40], [601, 55], [70]]
    assert got_logprobs.cu_num_generated_tokens == want_logprobs.cu_num_generated_tokens
    assert_array_equal(got_logprobs.logprob_token_ids, want_logprobs.logprob_token_ids)
    assert_array_equal(got_logprobs.sampled_token_ranks, want_logprobs.sampled_token_ranks)
    np.testing.assert_allclose(got_logprobs.logprobs, want_logprobs.logprobs, rtol=1e-5, atol=1e-5)


def test_prompt_logprobs_beside_drafts_verified_on_the_device(vllm_config):
    """d's whole prompt arrives, asking for prompt logprobs, in a step that verifies a's and b's
    drafts: the device still verifies the step, and the step's tokens and d's prompt logprobs
    are those of the step sent to the host, where vLLM's `RejectionSampler` verifies it."""
    import mlx.core as mx
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.device_sampling import DeviceSampler
    from vllm_metal.backends.mlx.runner.prompt_logprobs import prompt_logprob_rows
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.sample import sample_step
    from vllm_metal.backends.mlx.runner.spec_decode.kernels import register_rejection_kernels
    from vllm_metal.backends.mlx.runner.step import StepState

    register_rejection_kernels()  # as the engine does at start-up
    outputs = {}
    for where in ("device", "host"):
        states = RequestStates(vllm_config, [BS])
        params = SamplingParams(temperature=0.0, prompt_logprobs=2)
        packed, _ = three_verifying(states, new=[new_req("d", span(400, 5), [[11]], params=params)])
        rows = prompt_logprob_rows(states, packed)
        assert list(rows) == ["d"] and len(rows["d"]) == 4
        rng = np.random.default_rng(3)
        shape = (len(packed.logits_indices), states.vocab_size)  # d's last prompt row only
        table = rng.standard_normal(shape).astype(np.float32)
        table[[0, 1, 4], [501, 502, 601]] = 8.0  # a accepts two drafts, b its one
        logits = mx.array(table)
        prompt_logits = {"d": mx.array(rng.standard_normal((4, states.vocab_size), np.float32))}
        # The scheduler output is read for a grammar only.
        state = StepState(None, packed, logits, prompt_logits)
        if where == "device":
            assert verify.verifies_on_device(states)
            batch = states.input_batch
            tokens, accepts, processed = verify.device_verdicts(
                logits, packed, batch, mx.random.key(0)
            )
            state.verdicts = (tokens, accepts)
            state.device_logprobs, state.logprob_values = verify.verdict_logprobs(
                logits, tokens, processed, batch.sampling_metadata, "raw_logprobs"
            )
        sampler = Sampler()
        outputs[where] = sample_step(
            state, states, sampler, "raw_logprobs", RejectionSampler(sampler), DeviceSampler(0)
        )
    got, want = outputs["device"], outputs["host"]
    assert got.sampled_token_ids == want.sampled_token_ids
    assert [len(t) for t in got.sampled_token_ids] == [3, 2, 1, 1]
    assert list(got.prompt_logprobs_dict) == list(want.prompt_logprobs_dict) == ["d"]
    ours, theirs = got.prompt_logprobs_dict["d"], want.prompt_logprobs_dict["d"]
    assert ours.logprob_token_ids.shape == (4, 3)
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert_array_equal(getattr(ours, field).numpy(), getattr(theirs, field).numpy())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_penalties_count_the_drafts_before_each_row_as_in_vllm(states, mode):
    """Greedy rows with penalties (a: presence, b: repetition, c: frequency) verified on the
    device: each row counts its request's outputs and the drafts before it (the bonus row all
    of them), as vLLM's samplers do. Every token a row must not repeat leads its logits by a
    margin its penalty removes, so a's drafts are accepted only if the drafts before them count
    and its bonus is 40 only if they all do. Tokens and logprobs equal vLLM's
    `RejectionSampler`'s over the same logits."""
    params = {
        "a": SamplingParams(temperature=0.0, presence_penalty=1.0, logprobs=2),
        "b": SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2),
        "c": SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=2),
    }
    packed, _ = three_verifying(states, params)
    assert verify.verifies_on_device(states)
    rng = np.random.default_rng(2)
    logits = 0.5 * rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    for row, values in {  # a's output so far is 500, b's prompt 200..202 and output 600, c's 700
        0: {501: 5.0, 500: 5.5},
        1: {502: 5.0, 501: 5.5},
        2: {503: 5.0, 502: 5.5},
        3: {40: 5.0, 503: 5.5},
        4: {601: 5.0, 200: 8.0},
        5: {55: 5.0, 600: 9.0},
        7: {70: 5.0, 700: 5.4},
    }.items():
        logits[row, list(values)] = list(values.values())
    got, got_logprobs = device_outputs(states, packed, logits, 0, mode)
    want, want_logprobs = vllm_outputs(states, packed, logits, mode)
    assert got == want == [[501, 502, 503, 40], [601, 55], [70]]
    assert_array_equal(got_logprobs.logprob_token_ids, want_logprobs.logprob_token_ids)
    assert_array_equal(got_logprobs.sampled_token_ranks, want_logprobs.sampled_token_ranks)
    np.testing.assert_allclose(got_logprobs.logprobs, want_logprobs.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("c_stops", "mode"),
    [("past_its_minimum", "raw_logprobs"), ("at_its_bonus", "processed_logprobs")],
)
def test_allowed_tokens_bad_words_and_min_tokens_as_in_vllm(states, c_stops, mode):
    """Greedy rows with the rules vLLM's verification applies besides penalties. a: bad words
    [88], [501, 77] and [502, 503, 41], matched against its outputs and the drafts before each
    row, and 5 tokens at least before its stop token 42; b: only tokens 55, 56, 600 and 601
    allowed; c: two drafts, 2 tokens at least before its stop token 70, so only its first row
    loses 70, and its bonus row too (vLLM's bonus sampler counts no drafts). Every banned token
    leads its row, so a draft is accepted, or the replacement is the one listed, only where the
    rule holds. Tokens and logprobs equal vLLM's `RejectionSampler`'s over the same logits."""
    a = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[42], logprobs=2)
    a._bad_words_token_ids = [[88], [501, 77], [502, 503, 41]]
    b = SamplingParams(temperature=0.0, allowed_token_ids=[55, 56, 600, 601], logprobs=2)
    c = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[70], logprobs=2)
    drafts = {"a": [501, 502, 503], "b": [601, -1], "c": [701, 702]}
    packed, _ = three_verifying(states, {"a": a, "b": b, "c": c}, drafts)
    assert verify.verifies_on_device(states)
    rng = np.random.default_rng(3)
    logits = 0.5 * rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    rows = {
        0: {88: 7.0, 42: 6.0, 501: 5.0},
        1: {77: 6.0, 502: 5.0},
        2: {42: 6.5, 503: 5.0},
        3: {42: 8.0, 41: 6.0, 40: 5.0},
        4: {99: 9.0, 601: 5.0},
        5: {123: 9.0, 56: 5.0, 55: 4.0},
        7: {70: 9.0, 701: 5.0},
        8: {70: 9.0, 702: 5.0} if c_stops == "past_its_minimum" else {702: 5.0},
        9: {70: 9.0, 71: 5.0},
    }
    for row, values in rows.items():
        logits[row, list(values)] = list(values.values())
    got, got_logprobs = device_outputs(states, packed, logits, 0, mode)
    want, want_logprobs = vllm_outputs(states, packed, logits, mode)
    c_out = [701, 70] if c_stops == "past_its_minimum" else [701, 702, 71]
    assert got == want == [[501, 502, 503, 40], [601, 56], c_out]
    assert_array_equal(got_logprobs.logprob_token_ids, want_logprobs.logprob_token_ids)
    assert_array_equal(got_logprobs.sampled_token_ranks, want_logprobs.sampled_token_ranks)
    np.testing.assert_allclose(got_logprobs.logprobs, want_logprobs.logprobs, rtol=1e-5, atol=1e-5)


def test_logit_bias_is_ignored_as_in_vllm(states):
    """vLLM builds no logit-bias processor under speculative decoding (it warns that the
    parameter will not work): a step with biased requests is verified on the device, and its
    tokens and logprobs are those of vLLM's host path, which ignores the biases. a: -30 on its
    first draft (accepted) and +10 on 60 (its bonus stays 40); c, no draft: +6 on 75 (71 stays)."""
    a = SamplingParams(temperature=0.0, logit_bias={501: -30.0, 60: 10.0}, logprobs=2)
    c = SamplingParams(temperature=0.0, logit_bias={75: 6.0}, logprobs=2)
    packed, _ = three_verifying(states, {"a": a, "c": c})
    assert verify.verifies_on_device(states)
    rng = np.random.default_rng(5)
    logits = 0.5 * rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    rows = {0: {501: 5.0}, 1: {502: 5.0}, 2: {503: 5.0}, 3: {40: 5.0, 60: -1.0}, 7: {71: 5.0}}
    for row, values in rows.items():
        logits[row, list(values)] = list(values.values())
    got, got_logprobs = device_outputs(states, packed, logits, 0, "processed_logprobs")
    want, want_logprobs = vllm_outputs(states, packed, logits, "processed_logprobs")
    assert got == want
    assert got[0] == [501, 502, 503, 40] and got[2] == [71]
    np.testing.assert_allclose(got_logprobs.logprobs, want_logprobs.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("on_device", [True, False], ids=["noise_on_device", "host"])
@pytest.mark.parametrize("seed", range(4))
def test_seeded_rows_are_drawn_by_position_as_on_the_host(states, seed, on_device):
    """A seeded sampled request verifying three drafts (each its row's likeliest token), and a
    seeded one with a presence penalty, a min-p (which vLLM does not apply under speculative
    decoding) and top-2 logprobs that does not draft, beside a greedy one: the step is verified
    on the device, the seeded requests' rows drawn by position there with their noise
    (`seeded.keyed_noise`), or on the host. Tokens and logprobs equal those of the host's path
    (vLLM's `RejectionSampler`, then the seeded rows redrawn by position,
    `seeded.resample_drafts`)."""
    params = {
        "a": SamplingParams(temperature=0.8, top_k=4, seed=seed),
        "c": SamplingParams(
            temperature=1.0, seed=100 + seed, presence_penalty=0.5, min_p=0.2, logprobs=2
        ),
    }
    packed, _ = three_verifying(states, params)
    assert verify.verifies_on_device(states)
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((packed.num_tokens, states.vocab_size)).astype(np.float32)
    for row, draft in ((0, 501), (1, 502), (2, 503), (4, 601), (5, 55)):
        logits[row, draft] = 5.0
    logits[7, 700] = 3.0  # c's output so far, which its presence penalty lowers
    got, got_logprobs = device_outputs(states, packed, logits, seed, "raw_logprobs", on_device)
    want, want_logprobs = vllm_outputs(states, packed, logits)
    assert got == want
    assert got[1] == [601, 55]
    # c's logprobs (a's rows have some too, the step's largest k, which vLLM hands no one: the
    # host's are those of the token before a's redraw).
    c_rows = slice(*want_logprobs.cu_num_generated_tokens[2:4])
    assert got_logprobs.cu_num_generated_tokens == want_logprobs.cu_num_generated_tokens
    for name in ("logprob_token_ids", "sampled_token_ranks", "logprobs"):
        got_c, want_c = getattr(got_logprobs, name)[c_rows], getattr(want_logprobs, name)[c_rows]
        np.testing.assert_allclose(got_c, want_c, rtol=1e-5, atol=1e-5, err_msg=name)
