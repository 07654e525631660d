"""A step whose rows all sample greedily takes the argmax computed on the device, token-identical
to vLLM's host `Sampler` on the same logits and without copying them (the other rules over the
logits: `test_sample_rules.py`); a seeded random row is drawn there too, with the noise its
generator gives at its position, the token vLLM's `Sampler` draws. Presence,
frequency and repetition penalties are applied on the device as vLLM applies them. Unseeded
random rows with a temperature, min-p, top-k and top-p are drawn on the device too, from the
distribution vLLM's `Sampler` draws from (chi-square against its own draws)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.sampler import Sampler

from tests.backends.mlx.runner.schedules import BS, new_req, schedule, span, step
from tests.backends.mlx.runner.stats import chi2_pvalue
from vllm_metal.backends.mlx.runner import sample, seeded
from vllm_metal.backends.mlx.runner.device_sampling import (
    DeviceSampler,
    sample_rows,
)
from vllm_metal.backends.mlx.runner.logits_rules import penalized
from vllm_metal.backends.mlx.runner.prompt_logprobs import prompt_logprob_rows
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.seeded import sampling_metadata
from vllm_metal.backends.mlx.runner.step import StepState

VOCAB = 64  # logits columns used (the rest of the tiny model's vocabulary is -inf)


def _run(
    vllm_config,
    params: dict[str, SamplingParams],
    on_device: bool,
    monkeypatch,
    with_output=False,
    grammar=None,
    placeholders=None,
):
    """One step of requests a (decode-sized prompt, sampled), b (mid-prefill: discarded) and c,
    sampled from fixed logits; returns (sampled ids, whether the logits went to the host).
    `placeholders`: draft placeholders vLLM scheduled (request -> count) that the step does not
    verify (speculative decoding under async scheduling, none proposed)."""
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
    # Rows of the requests asking for prompt logprobs, as `Sampling.finish_step` takes them.
    prompt_logits = {
        req_id: mx.array(rng.standard_normal((len(rows), vocab)).astype(np.float32))
        for req_id, rows in prompt_logprob_rows(states, packed).items()
    }
    tokens = logprobs = values = keyed = None
    if on_device:  # as `Sampling.finish_step` queues them
        keyed = seeded.keyed_noise(states, packed, vocab)
        tokens, logprobs, values = DeviceSampler(0).outputs(
            logits, states.input_batch, "raw_logprobs", keyed=keyed
        )
    copied = []
    real = sample.to_torch
    monkeypatch.setattr(sample, "to_torch", lambda a: copied.append(a) or real(a))
    state = StepState(
        sched,
        packed,
        logits,
        prompt_logits,
        device_tokens=tokens,
        device_logprobs=logprobs,
        logprob_values=values,
        keyed=keyed,
    )
    state.grammar_output = grammar
    if placeholders:
        state.scheduler_output = replace(
            sched, scheduled_spec_decode_tokens={r: [-1] * n for r, n in placeholders.items()}
        )
    device = DeviceSampler(0) if on_device else None
    output = sample.sample_step(state, states, Sampler(), "raw_logprobs", None, device)
    by_req = dict(zip(output.req_ids, output.sampled_token_ids))
    if with_output:
        return by_req, bool(copied), output
    return by_req, bool(copied)


def test_greedy_rows_sample_on_the_device_like_the_host_sampler(vllm_config, monkeypatch):
    greedy = {r: SamplingParams(temperature=0.0) for r in "abc"}
    device, copied = _run(vllm_config, greedy, True, monkeypatch)
    host, host_copied = _run(vllm_config, greedy, False, monkeypatch)
    assert not copied and host_copied
    assert device == host
    assert device["b"] == [] and len(device["a"]) == len(device["c"]) == 1


def test_prompt_logprobs_leave_the_step_on_the_device(vllm_config, monkeypatch):
    """Requests asking for prompt logprobs (a: its whole prompt in the step, so they are
    reported; b: the first chunk of its prompt) beside one asking for logprobs: the step's
    tokens and logprobs are drawn on the device (its logits never copied), and they and the
    prompt logprobs are those of vLLM's samplers on the host."""
    params = {"a": SamplingParams(temperature=0.0, prompt_logprobs=2),
              "b": SamplingParams(temperature=0.0, prompt_logprobs=1),
              "c": SamplingParams(temperature=0.0, logprobs=2)}  # fmt: skip
    device, copied, ours = _run(vllm_config, params, True, monkeypatch, with_output=True)
    host, host_copied, theirs = _run(vllm_config, params, False, monkeypatch, with_output=True)
    assert not copied and host_copied
    assert device == host
    np.testing.assert_array_equal(
        ours.logprobs.logprob_token_ids, theirs.logprobs.logprob_token_ids
    )
    assert list(ours.prompt_logprobs_dict) == list(theirs.prompt_logprobs_dict) == ["a"]
    got, want = ours.prompt_logprobs_dict["a"], theirs.prompt_logprobs_dict["a"]
    assert got.logprob_token_ids.shape == (2, 3)  # a's 3 prompt tokens: 2 rows, k + 1 each
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field))


def _bitmask(vocab: int, allowed: list[list[int]]) -> np.ndarray:
    """xgrammar's layout: bit j of word i allows token 32 i + j."""
    bits = np.zeros((len(allowed), -(-vocab // 32) * 32), dtype=np.uint8)
    for row, tokens in enumerate(allowed):
        bits[row, tokens] = 1
    words = np.packbits(bits.reshape(len(allowed), -1, 32), axis=-1, bitorder="little")
    return words.view(np.uint32).reshape(len(allowed), -1).view(np.int32)


@pytest.mark.parametrize(
    "c",
    [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    + [SamplingParams(temperature=1.5, seed=s) for s in range(4)],
)
def test_grammar_rows_are_masked_on_the_device(vllm_config, monkeypatch, c):
    """A grammar's bitmask applied on the device: the rows it constrains pick among the tokens
    it allows, as vLLM's `apply_grammar_bitmask` and sampler pick, without copying logits (a
    seeded row the very token the sampler draws for it)."""
    from vllm.v1.core.sched.output import GrammarOutput

    vocab = RequestStates(vllm_config, [BS]).vocab_size
    allowed = [2, 7, 40, 63]  # c's grammar; a is unconstrained, b mid-prefill
    grammar = GrammarOutput(["c", "b"], _bitmask(vocab, [allowed, [5]]))
    params = {"a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.0), "c": c}
    device, copied = _run(vllm_config, params, True, monkeypatch, grammar=grammar)
    host, host_copied = _run(vllm_config, params, False, monkeypatch, grammar=grammar)
    free, _ = _run(vllm_config, params, True, monkeypatch)
    assert not copied and host_copied
    assert device["c"][0] in allowed and device["a"] == free["a"] == host["a"]
    if c.temperature == 0.0:
        assert device == host and free["c"][0] not in allowed  # the mask moved the argmax
    if c.seed is not None:
        assert device == host


def test_grammar_rows_take_their_own_bitmask_rows_beside_unverified_placeholders(
    vllm_config, monkeypatch
):
    """Under speculative decoding vLLM lays each structured request's bitmask out over the
    drafts it scheduled (here two placeholders for a, which the step does not verify): a's
    first row and c's row mask a and c, as vLLM's `apply_grammar_bitmask` masks them."""
    from vllm.v1.core.sched.output import GrammarOutput

    vocab = RequestStates(vllm_config, [BS]).vocab_size
    a_allowed, c_allowed, other = [3, 9], [2, 7, 40], list(range(VOCAB))
    grammar = GrammarOutput(["a", "c"], _bitmask(vocab, [a_allowed, other, other, c_allowed]))
    params = {r: SamplingParams(temperature=0.0) for r in "abc"}
    device, copied = _run(
        vllm_config, params, True, monkeypatch, grammar=grammar, placeholders={"a": 2}
    )
    host, _ = _run(vllm_config, params, False, monkeypatch, grammar=grammar, placeholders={"a": 2})
    free, _ = _run(vllm_config, params, True, monkeypatch)
    assert not copied and device == host
    assert device["a"][0] in a_allowed and device["c"][0] in c_allowed, device
    assert free["c"][0] not in c_allowed  # the mask moved c's argmax


def test_a_seeded_row_is_drawn_on_the_device_as_the_host_sampler_draws_it(vllm_config, monkeypatch):
    """A seeded row beside greedy and unseeded ones: no logits reach the host, and its token is
    the one vLLM's sampler draws for it over the whole batch with its generator keyed to the
    position (12 seeds, top-k and top-p)."""
    draws = set()
    for s in range(12):
        params = {"a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.7),
                  "c": SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=s)}  # fmt: skip
        device, copied = _run(vllm_config, params, True, monkeypatch)
        host, _ = _run(vllm_config, params, False, monkeypatch)
        assert not copied and device["c"] == host["c"] and device["a"] == host["a"], s
        draws.add(device["c"][0])
    assert len(draws) > 1  # sampled, not the argmax


@pytest.mark.parametrize("k", [0, 2, 5])
def test_logprobs_come_from_the_device_as_the_host_sampler_gives_them(vllm_config, monkeypatch, k):
    """vLLM's raw logprobs: the sampled token's and the k most likely, with its rank; one row
    asks for k, another for fewer (the batch's largest k is computed for every row)."""
    params = {"a": SamplingParams(temperature=0.0, logprobs=k), "b": SamplingParams(temperature=0.0),
              "c": SamplingParams(temperature=0.0, logprobs=min(k, 1), repetition_penalty=2.0)}  # fmt: skip
    device, copied, ours = _run(vllm_config, params, True, monkeypatch, with_output=True)
    host, _, theirs = _run(vllm_config, params, False, monkeypatch, with_output=True)
    assert not copied and device == host
    assert ours.logprobs.logprob_token_ids.shape == (3, k + 1)
    np.testing.assert_array_equal(
        ours.logprobs.logprob_token_ids, theirs.logprobs.logprob_token_ids
    )
    np.testing.assert_array_equal(
        ours.logprobs.sampled_token_ranks, theirs.logprobs.sampled_token_ranks
    )
    np.testing.assert_allclose(
        ours.logprobs.logprobs, theirs.logprobs.logprobs, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "penalty",
    [{"repetition_penalty": 3.0}, {"repetition_penalty": 0.2}, {"presence_penalty": 1.5}],
    ids=["repetition", "repetition_below_1", "presence"],
)
def test_penalized_rows_sample_on_the_device_like_the_host_sampler(
    vllm_config, monkeypatch, penalty
):
    params = {r: SamplingParams(temperature=0.0, **penalty) for r in "ac"}
    params["b"] = SamplingParams(temperature=0.0)
    device, copied = _run(vllm_config, params, True, monkeypatch)
    host, _ = _run(vllm_config, params, False, monkeypatch)
    plain, _ = _run(
        vllm_config, {r: SamplingParams(temperature=0.0) for r in "abc"}, True, monkeypatch
    )
    assert not copied
    assert device == host
    if penalty.get("repetition_penalty") == 0.2:  # boosts the prompt's tokens: a prompt token
        assert device != plain and device["c"][0] in span(30, 4)


def test_penalties_equal_vllms():
    """`penalized` against vLLM's `apply_all_penalties` on random logits, prompts (padded with
    the vocabulary size) and outputs (with a -1 placeholder), all three penalties per row."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    rng = np.random.default_rng(4)
    rows, vocab = 5, 50
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    prompt = np.full((rows, 9), vocab)
    outputs = []
    for r in range(rows):
        prompt[r, : 3 + r] = rng.integers(0, vocab, 3 + r)
        outputs.append(rng.integers(0, 12, 2 * r).tolist() + ([-1] if r == 2 else []))
    penalties = [torch.tensor(rng.uniform(lo, hi, rows), dtype=torch.float32)
                 for lo, hi in ((0.5, 2.0), (-1.0, 1.0), (-1.0, 1.0))]  # fmt: skip

    class Metadata:
        prompt_token_ids = torch.tensor(prompt)
        repetition_penalties, presence_penalties, frequency_penalties = penalties
        output_token_ids = outputs

    got = np.array(penalized(mx.array(logits), Metadata))
    want = apply_all_penalties(
        torch.tensor(logits), torch.tensor(prompt), penalties[1], penalties[2], penalties[0],
        [list(o) for o in outputs],
    ).numpy()  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, logits)


def test_unseeded_random_rows_sample_on_the_device(vllm_config, monkeypatch):
    """Random rows beside a greedy one: no logits copied, the greedy row's argmax, the random
    rows' tokens among their top 3; a logprobs request beside them stays on the device too."""
    params = {
        "a": SamplingParams(temperature=0.8, top_k=3, min_p=0.1),
        "b": SamplingParams(temperature=1.0, top_p=0.5),
        "c": SamplingParams(temperature=0.0),
    }
    device, copied = _run(vllm_config, params, True, monkeypatch)
    greedy, _ = _run(
        vllm_config, {r: SamplingParams(temperature=0.0) for r in "abc"}, True, monkeypatch
    )
    assert not copied
    assert device["b"] == [] and device["c"] == greedy["c"]
    table = np.random.default_rng(0).standard_normal((3, VOCAB))
    assert device["a"][0] in np.argsort(-table[0])[:3]
    with_logprobs = {**params, "c": SamplingParams(temperature=0.0, logprobs=1)}
    _, copied, output = _run(vllm_config, with_logprobs, True, monkeypatch, with_output=True)
    assert not copied and output.logprobs.logprobs.shape == (3, 2)


def _min_p_processor(vllm_config, min_p: float, n: int) -> MinPLogitsProcessor:
    """vLLM's min-p processor holding `min_p` for `n` rows (as its batch updates leave it)."""
    proc = MinPLogitsProcessor(vllm_config, torch.device("cpu"), False)
    proc.min_p_cpu[:n] = min_p
    proc.min_p_count = n
    proc.min_p = torch.full((n, 1), min_p)
    return proc


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (0.8, None, None, None),
        (1.0, 3, None, None),
        (0.7, None, 0.8, None),
        (1.3, 5, 0.6, None),
        (0.5, 2, 0.99, None),
        (1.2, None, None, 0.2),
        (0.9, 6, 0.9, 0.05),
    ],
)
def test_device_draws_follow_the_host_samplers_distribution(
    vllm_config, temperature, top_k, top_p, min_p
):
    n, vocab = 4000, 10
    logits = torch.tensor(
        np.random.default_rng(1).standard_normal(vocab) * 1.5, dtype=torch.float32
    )
    rows = logits.repeat(n, 1)
    t = np.full(n, temperature, np.float32)
    k = None if top_k is None else np.full(n, top_k, np.int32)
    p = None if top_p is None else np.full(n, top_p, np.float32)
    m = None if min_p is None else np.full(n, min_p, np.float32)
    drawn = np.array(sample_rows(mx.array(rows.numpy()), t, k, p, mx.random.key(3), m)[0])
    metadata = sampling_metadata(
        torch.from_numpy(t),
        {},
        top_k=None if k is None else torch.from_numpy(k),
        top_p=None if p is None else torch.from_numpy(p),
    )
    if min_p is not None:
        metadata.logitsprocs = LogitsProcessors([_min_p_processor(vllm_config, min_p, n)])
    torch.manual_seed(0)
    host = Sampler()(rows.clone(), metadata).sampled_token_ids.view(-1).numpy()
    assert set(drawn.tolist()) <= set(host.tolist())  # the same support (top-k, top-p)
    assert chi2_pvalue(drawn.tolist(), host.tolist()) > 1e-3


def test_the_distribution_check_catches_a_wrong_temperature():
    n, vocab = 4000, 10
    logits = torch.tensor(
        np.random.default_rng(1).standard_normal(vocab) * 1.5, dtype=torch.float32
    )
    rows = logits.repeat(n, 1)
    drawn = np.array(
        sample_rows(
            mx.array(rows.numpy()), np.full(n, 0.7, np.float32), None, None, mx.random.key(3)
        )[0]
    )
    metadata = sampling_metadata(torch.full((n,), 1.0), {})
    host = Sampler()(rows.clone(), metadata).sampled_token_ids.view(-1).numpy()
    assert chi2_pvalue(drawn.tolist(), host.tolist()) < 1e-3
