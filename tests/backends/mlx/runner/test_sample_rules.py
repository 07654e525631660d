"""Each request's rules over its logits (a logit bias, min tokens, allowed token ids, bad words,
beside the penalties) are applied on the device: a decode step whose rows ask for them keeps the
tokens drawn on the device, token-identical to vLLM's host `Sampler` for greedy rows and drawn
from its distribution for random ones (chi-square against its own draws), without copying the
logits. Logprobs of named tokens, and more than 20, come from the device too. A seeded row with
rules, or asking for logprobs, is drawn apart on the host from its own row; a custom logits processor sends the whole
step to the host."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.sampler import Sampler

from tests.backends.mlx.runner.schedules import BS, Cached, new_req, sample, schedule, span, step
from tests.backends.mlx.runner.stats import chi2_pvalue
from vllm_metal.backends.mlx.runner import sample as sampling
from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.device_sampling import DeviceSampler
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.step import StepState
from vllm_metal.backends.mlx.runner.tensors import to_torch

VOCAB = 64  # logits columns used (the rest of the tiny model's vocabulary is -inf)
PROMPTS = {"a": span(10, 3), "b": span(20, 6), "c": span(30, 4)}
OUTPUTS = {"a": [40, 41, 42], "c": [43, 44]}  # what a and c sampled before the decode step


def _table(seed: int, rows: int, vocab: int) -> np.ndarray:
    table = np.full((rows, vocab), -np.inf, np.float32)
    table[:, :VOCAB] = np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 2
    return table


def _ranked(seed: int, row: int) -> np.ndarray:
    """Row `row`'s tokens of `_table(seed)`, most likely first."""
    return np.argsort(-_table(seed, 3, VOCAB)[row])


def _decode_step(vllm_config, params: dict[str, SamplingParams]):
    """a and c decode after their earlier outputs (`OUTPUTS`), b is mid-prefill (discarded)."""
    states = RequestStates(vllm_config, [BS])
    first = schedule(
        {"a": 3, "b": 2, "c": 4},
        new=[
            new_req(r, PROMPTS[r], [[3 * i + 1, 3 * i + 2, 3 * i + 3]], params=params.get(r))
            for i, r in enumerate("abc")
        ],
    )
    step(states, first)
    sample(states, OUTPUTS)
    na, nc = len(OUTPUTS["a"]), len(OUTPUTS["c"])
    sched = schedule(
        {"a": 1, "b": 2, "c": 1},
        cached=[Cached("a", 3 + na - 1, na), Cached("b", 2, 0), Cached("c", 4 + nc - 1, nc)],
    )
    return states, sched, step(states, sched)


def _run(
    vllm_config,
    params,
    on_device,
    monkeypatch,
    seed=0,
    mode="raw_logprobs",
    setup=None,
    grammar=None,
):
    """The decode step sampled from `_table(seed)`; returns (tokens by request, the row counts
    of the logits copied to the host, the output)."""
    states, sched, packed = _decode_step(vllm_config, params)
    if setup is not None:
        setup(states)
    logits = mx.array(_table(seed, 3, states.vocab_size))
    tokens = logprobs = values = keyed = None
    if on_device:  # as `Sampling.finish_step` queues them
        keyed = seeded.keyed_noise(states, packed, logits.shape[-1])
        tokens, logprobs, values = DeviceSampler(seed).outputs(
            logits, states.input_batch, mode, keyed=keyed
        )
    copied = []
    monkeypatch.setattr(sampling, "to_torch", lambda a: copied.append(a.shape[0]) or to_torch(a))
    state = StepState(
        sched,
        packed,
        logits,
        {},
        device_tokens=tokens,
        device_logprobs=logprobs,
        logprob_values=values,
        keyed=keyed,
    )
    state.grammar_output = grammar
    device = DeviceSampler(seed) if on_device else None
    output = sampling.sample_step(state, states, Sampler(logprobs_mode=mode), mode, None, device)
    return dict(zip(output.req_ids, output.sampled_token_ids)), copied, output


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw})


def _bad_words(words: list[list[int]], **kw) -> SamplingParams:
    params = _greedy(**kw)
    params._bad_words_token_ids = words  # what `update_from_tokenizer` makes of the words
    return params


ROWS = {"a": 0, "c": 1, "b": 2}  # the batch's rows: decodes before the prefill chunk
TOP = _ranked(0, ROWS["c"])  # c's tokens at seed 0, most likely first
RULES = {
    "logit_bias": _greedy(logit_bias={int(TOP[3]): 3.0}),
    "min_tokens": _greedy(min_tokens=4, stop_token_ids=[int(TOP[0])]),
    "allowed_token_ids": _greedy(allowed_token_ids=[int(t) for t in TOP[5:9]]),
    "bad_word": _bad_words([[int(TOP[0])]]),
    # c's outputs end with 43, 44: the first word bans the argmax, the second (44 does not
    # follow 40) leaves the next one, the third (longer than the outputs + 1) is skipped.
    "bad_word_prefix": _bad_words(
        [[43, 44, int(TOP[0])], [40, 44, int(TOP[1])], [1, 2, 43, 44, int(TOP[1])]]
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_a_rule_moves_the_argmax_on_the_device_as_on_the_host(vllm_config, monkeypatch, rule):
    """c asks for the rule; a has reached its own minimum length (its stop token is kept)."""
    top_a = int(_ranked(0, 0)[0])
    params = {"a": _greedy(min_tokens=3, stop_token_ids=[top_a]), "c": RULES[rule]}
    device, copied, _ = _run(vllm_config, params, True, monkeypatch)
    host, host_copied, _ = _run(vllm_config, params, False, monkeypatch)
    plain, _, _ = _run(vllm_config, {}, True, monkeypatch)
    assert copied == [] and host_copied == [3]
    assert device == host
    assert device["c"] != plain["c"] and device["a"] == plain["a"] == [top_a]
    assert device["b"] == []


def test_min_tokens_restores_the_stop_tokens_a_grammar_leaves_alone(vllm_config, monkeypatch):
    """A structured-output row under its minimum whose grammar allows nothing but its stop
    tokens: vLLM's min-tokens processor gives back their logits (the row is not left all
    -inf), and the device does the same; the other row's grammar leaves it more to pick."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.output import GrammarOutput

    from tests.backends.mlx.runner.test_sample import _bitmask

    stops = [int(TOP[4]), int(TOP[7])]
    top_a = _ranked(0, ROWS["a"])
    structured = StructuredOutputsParams(regex="a")
    params = {
        "a": _greedy(min_tokens=9, stop_token_ids=[int(top_a[0])], structured_outputs=structured),
        "c": _greedy(min_tokens=9, stop_token_ids=stops, structured_outputs=structured),
    }
    vocab = RequestStates(vllm_config, [BS]).vocab_size
    allowed = [[int(top_a[0]), int(top_a[1])], stops]
    grammar = GrammarOutput(["a", "c"], _bitmask(vocab, allowed))
    device, copied, _ = _run(vllm_config, params, True, monkeypatch, grammar=grammar)
    host, _, _ = _run(vllm_config, params, False, monkeypatch, grammar=grammar)
    assert copied == [] and device == host
    assert device["c"] == [stops[0]] and device["a"] == [int(top_a[1])]


def _every_rule(rng) -> dict[str, SamplingParams]:
    """Random rules on every row, with penalties over the same tokens."""
    params = {}
    for r in "abc":
        tokens = rng.choice(VOCAB, 12, replace=False).tolist()
        params[r] = _bad_words(
            [[tokens[0]], [OUTPUTS.get(r, [0])[-1], tokens[1]]],
            logit_bias={t: float(b) for t, b in zip(tokens[2:6], rng.uniform(-3, 3, 4))},
            min_tokens=5,
            stop_token_ids=tokens[6:8],
            allowed_token_ids=tokens[2:] + PROMPTS[r][:2] + OUTPUTS.get(r, [])[:2],
            repetition_penalty=float(rng.uniform(0.3, 3.0)),
            presence_penalty=float(rng.uniform(-1, 1)),
            frequency_penalty=float(rng.uniform(-1, 1)),
        )
    return params


def test_rules_together_follow_vllms_order(vllm_config, monkeypatch):
    """Every rule on every row at once, over 12 random tables and rule sets: the device's
    argmax equals the host's (a rule applied before or after another where vLLM does not
    moves some argmax)."""
    rng = np.random.default_rng(5)
    for seed in range(12):
        params = _every_rule(rng)
        device, copied, _ = _run(vllm_config, params, True, monkeypatch, seed=seed)
        host, _, _ = _run(vllm_config, params, False, monkeypatch, seed=seed)
        assert copied == [] and device == host, seed


def test_random_rows_with_rules_follow_the_host_samplers_distribution(vllm_config):
    """A random row with a temperature, top-k, a logit bias, bad words, allowed tokens, min
    tokens and a penalty: 800 device draws against 800 of vLLM's `Sampler` over the same
    batch."""
    top = _ranked(0, 0)
    params = {
        "a": _bad_words(
            [[int(top[0])]],
            logit_bias={int(top[3]): 2.0, int(top[1]): -1.5},
            repetition_penalty=1.5,
            allowed_token_ids=[int(t) for t in top[:9]],
            min_tokens=9,
            stop_token_ids=[int(top[2])],
            top_k=4,
            temperature=0.5,
        ),
        "c": _greedy(logit_bias={int(TOP[2]): 4.0}),
    }
    states, _, _ = _decode_step(vllm_config, params)
    assert states.input_batch.req_ids == list(ROWS)
    table = _table(0, 3, states.vocab_size)
    device, batch, n = DeviceSampler(1), states.input_batch, 800
    drawn = [device.draw(mx.array(table), batch).tokens for _ in range(n)]
    mx.eval(drawn)
    drawn = np.stack([np.array(d) for d in drawn])
    torch.manual_seed(0)
    sampler, metadata = Sampler(), batch.sampling_metadata
    host = np.stack(
        [
            sampler(torch.tensor(table), metadata).sampled_token_ids.view(-1).numpy()
            for _ in range(n)
        ]
    )
    assert set(drawn[:, 0].tolist()) <= set(host[:, 0].tolist())
    assert len(set(host[:, 0].tolist())) == 4 and not {top[0], top[2]} & set(host[:, 0])
    assert chi2_pvalue(drawn[:, 0].tolist(), host[:, 0].tolist()) > 1e-3
    c = ROWS["c"]
    assert (drawn[:, c] == host[:, c]).all() and host[0, c] == TOP[2]  # the greedy row


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
@pytest.mark.parametrize(
    "asks",
    [{"a": {"logprobs": 30}}, {"a": {"logprob_token_ids": [5, 9]}, "c": {"logprobs": 2}}],
    ids=["more_than_20", "named_tokens"],
)
def test_logprobs_come_from_the_device_as_the_host_gives_them(vllm_config, monkeypatch, asks, mode):
    """Logprobs of the raw logits (before c's logit bias) for more than 20 tokens, or for named
    ones (vLLM then gives every row the named tokens' only), without copying logits."""
    params = {r: _greedy(**kw) for r, kw in asks.items()}
    params["c"] = _greedy(logit_bias={int(TOP[3]): 3.0}, **asks.get("c", {}))
    _, copied, ours = _run(vllm_config, params, True, monkeypatch, mode=mode)
    _, _, theirs = _run(vllm_config, params, False, monkeypatch, mode=mode)
    assert copied == [] and ours.sampled_token_ids == theirs.sampled_token_ids
    mine, want = ours.logprobs, theirs.logprobs
    np.testing.assert_array_equal(mine.logprob_token_ids, want.logprob_token_ids)
    np.testing.assert_array_equal(mine.sampled_token_ranks, want.sampled_token_ranks)
    np.testing.assert_allclose(mine.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    assert mine.logprob_token_ids.shape[1] in (31, 3)


def test_a_seeded_row_with_rules_is_drawn_on_the_device(vllm_config, monkeypatch):
    """A seeded row with a logit bias, a bad word and min-p beside greedy rows with rules: no
    logits reach the host, and its token is the one vLLM's sampler draws for it over the whole
    batch, for each of 12 seeds."""

    def seeded(seed: int) -> SamplingParams:
        return _bad_words(
            [[int(TOP[0])]],
            logit_bias={int(TOP[5]): 2.0},
            min_p=0.2,
            top_k=6,
            seed=seed,
            temperature=1.0,
        )

    others = {"a": _greedy(logit_bias={1: 50.0}), "b": _greedy()}
    draws = set()
    for s in range(12):
        params = {**others, "c": seeded(s)}
        device, copied, _ = _run(vllm_config, params, True, monkeypatch)
        host, _, _ = _run(vllm_config, params, False, monkeypatch)
        assert copied == [] and device == host and device["a"] == [1], s
        draws.add(device["c"][0])
    assert len(draws) > 1 and int(TOP[0]) not in draws


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_a_seeded_row_asking_for_logprobs_is_drawn_on_the_device(vllm_config, monkeypatch, mode):
    """A seeded row asking for logprobs beside a greedy row asking for more: no logits reach the
    host, and the tokens and logprobs of every row equal vLLM's sampler's over the whole batch
    (its own sampled token's value and rank included), for each of 8 seeds."""
    draws = set()
    for s in range(8):
        params = {
            "a": _greedy(logprobs=4),
            "c": SamplingParams(temperature=1.0, top_k=8, seed=s, logprobs=2),
        }
        _, copied, ours = _run(vllm_config, params, True, monkeypatch, mode=mode)
        _, _, theirs = _run(vllm_config, params, False, monkeypatch, mode=mode)
        assert copied == [] and ours.sampled_token_ids == theirs.sampled_token_ids, s
        mine, want = ours.logprobs, theirs.logprobs
        np.testing.assert_array_equal(mine.logprob_token_ids, want.logprob_token_ids)
        np.testing.assert_array_equal(mine.sampled_token_ranks, want.sampled_token_ranks)
        np.testing.assert_allclose(mine.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
        draws.add(ours.sampled_token_ids[ROWS["c"]][0])
    assert len(draws) > 1 and draws != {int(TOP[0])}


class _BanToken(LogitsProcessor):
    """A custom processor: bans token `token` in every row."""

    def __init__(self, token: int):
        self.token = token

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, self.token] = float("-inf")
        return logits


def test_a_custom_processor_keeps_the_whole_step_on_the_host(vllm_config, monkeypatch):
    def add(states):
        states.input_batch.logitsprocs.non_argmax_invariant.append(_BanToken(int(TOP[0])))

    params = {"a": _greedy(logit_bias={3: 1.0})}
    device, copied, _ = _run(vllm_config, params, True, monkeypatch, setup=add)
    assert copied == [3] and device["c"] == [int(TOP[1])]


def _assert_logprobs_equal(mine, want) -> None:
    np.testing.assert_array_equal(mine.logprob_token_ids, want.logprob_token_ids)
    np.testing.assert_array_equal(mine.sampled_token_ranks, want.sampled_token_ranks)
    np.testing.assert_allclose(mine.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_of_greedy_rows_come_from_the_device(vllm_config, monkeypatch, mode):
    """vLLM's processed modes over greedy rows: the logits after each row's rules (c's logit
    bias, a's penalty), without copying logits."""
    params = {"a": _greedy(logprobs=2, presence_penalty=1.5), "c": RULES["logit_bias"]}
    params["c"].logprobs = 3
    device, copied, ours = _run(vllm_config, params, True, monkeypatch, mode=mode)
    host, _, theirs = _run(vllm_config, params, False, monkeypatch, mode=mode)
    assert copied == [] and device == host
    _assert_logprobs_equal(ours.logprobs, theirs.logprobs)


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processed_logprobs_of_random_rows_come_from_the_device(vllm_config, monkeypatch, mode):
    """A random row with a temperature, min-p, top-k and top-p beside a greedy row: its
    processed values are those it was drawn from (the tokens top-k, top-p and min-p drop at
    -inf), as vLLM's sampler gives them; the greedy row's at temperature 1. The device and the
    host draw different tokens, so the sampled column is checked against the host's top list,
    which holds every token the row keeps."""
    params = {
        "a": _greedy(logprobs=3),
        "c": SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=6),
    }
    _, copied, ours = _run(vllm_config, params, True, monkeypatch, mode=mode)
    _, _, theirs = _run(vllm_config, params, False, monkeypatch, mode=mode)
    assert copied == []
    mine, want = ours.logprobs, theirs.logprobs
    # The tokens a row drops tie at -inf, in no order.
    kept = np.isfinite(want.logprobs[:, 1:])
    ids, want_ids = mine.logprob_token_ids[:, 1:], want.logprob_token_ids[:, 1:]
    np.testing.assert_array_equal(np.where(kept, ids, -1), np.where(kept, want_ids, -1))
    np.testing.assert_allclose(mine.logprobs[:, 1:], want.logprobs[:, 1:], rtol=1e-5, atol=1e-5)
    c = ROWS["c"]
    assert 1 <= np.isfinite(want.logprobs[c, 1:]).sum() <= 5  # top-k (and more) dropped some
    top = dict(zip(want.logprob_token_ids[c, 1:].tolist(), want.logprobs[c, 1:].tolist()))
    token, value = int(mine.logprob_token_ids[c, 0]), float(mine.logprobs[c, 0])
    assert token == ours.sampled_token_ids[c][0] and np.isfinite(top[token])
    np.testing.assert_allclose(value, top[token], rtol=1e-5, atol=1e-5)
    assert mine.sampled_token_ranks[c] == sum(v >= top[token] for v in top.values())


@pytest.mark.parametrize(
    ("params", "reads"),
    [
        (_greedy(logit_bias={3: 1.0}, allowed_token_ids=[3, 4]), False),
        (_greedy(min_tokens=4, stop_token_ids=[3]), True),
        (_bad_words([[3]]), True),
        (_greedy(presence_penalty=0.5), True),
    ],
    ids=["bias_and_allowed", "min_tokens", "bad_words", "penalty"],
)
def test_rules_that_count_outputs_are_told_apart(vllm_config, params, reads):
    """Min tokens, bad words and penalties read the outputs so far: a step verifying drafts
    beside them, whose rules count the drafts, is not carried into the next (a decode step is:
    they count the carried tokens, below and `test_step_pipeline.py`)."""
    states, _, _ = _decode_step(vllm_config, {"c": params})
    assert sampling.reads_outputs(states.input_batch.sampling_metadata) is reads


@pytest.mark.parametrize("carried", [7, 8, 9])
def test_bad_words_with_a_carried_token_ban_what_the_recorded_token_would(carried):
    """A row whose last output is still on the device gets the bans the host's function gives
    for its list with that token appended: a word ending in the carried token's successor is
    banned only where the carried token completes its prefix."""
    from vllm_metal.backends.mlx.runner.logits_rules import bad_words_masked

    vocab = 16
    words = {0: [[5], [8, 3], [6, 7, 4], [9, 9, 2], [1, 7, 11]], 1: [[6, 7, 12], [7, 13]]}
    outputs = [[4, 6], [2, 6, 7]]
    logits = mx.zeros((2, vocab))

    def banned(metadata, unrecorded):
        out = np.array(
            bad_words_masked(
                logits, metadata.bad_words_token_ids, metadata.output_token_ids, unrecorded
            )
        )
        return {(r, t) for r, t in zip(*np.nonzero(np.isinf(out)))}

    from types import SimpleNamespace

    unrecorded = (np.array([0]), mx.array([carried]))
    got = banned(SimpleNamespace(bad_words_token_ids=words, output_token_ids=outputs), unrecorded)
    appended = [outputs[0] + [carried], outputs[1]]
    want = banned(SimpleNamespace(bad_words_token_ids=words, output_token_ids=appended), None)
    assert got == want
    assert ((0, 4) in got) == (carried == 7) and ((0, 3) in got) == (carried == 8)
    assert {(1, 12), (1, 13), (0, 5)} <= got  # row 1 has nothing carried; one-token words


def test_min_tokens_count_outputs_recorded_since_the_processor_did_and_carried_ones():
    """A row leaves the min-tokens rows once its outputs reach the minimum: the host's list as
    it is now (vLLM's processor counted it at the last batch update) plus the outputs still on
    the device."""
    from vllm_metal.backends.mlx.runner.logits_rules import still_short

    stops = {3}
    min_toks = {
        0: (4, [7, 8, 9], stops, False),
        1: (4, [7, 8], stops, False),
        2: (2, [5, 5], stops, False),
    }
    assert set(still_short(min_toks, None)) == {0, 1}  # row 2's list reached 2 since
    carried = (np.array([0, 1]), mx.array([11, 12]))
    assert set(still_short(min_toks, carried)) == {1}  # row 0's carried token is its fourth
