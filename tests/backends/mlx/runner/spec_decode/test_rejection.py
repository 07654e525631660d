"""vLLM's real `RejectionSampler(Sampler())` running on the torch kernels of
`vllm_metal.backends.mlx.runner.spec_decode.kernels`: exact greedy outputs, in-place expansion of
float sampling parameters, statistical losslessness (the first output token, and the second after
an accepted draft, follow the processed target distribution; a chi-square test with negative
controls proving it rejects broken acceptance rules) and reproducibility with seeded generators."""

from __future__ import annotations

import pytest
import torch
import vllm.v1.sample.rejection_sampler as rs
from vllm.triton_utils import HAS_TRITON, dispatcher
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from vllm_metal.backends.mlx.runner.spec_decode import kernels
from vllm_metal.backends.mlx.runner.spec_decode.kernels import register_rejection_kernels

V = 8
N_TRIALS = 20_000
# Upper 0.001 quantiles of the chi-square distribution by degrees of freedom.
CHI2_CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
TARGET_LOGITS = torch.tensor([2.0, 1.4, 1.1, 0.6, 0.2, -0.3, -0.9, 0.9])
SECOND_LOGITS = torch.tensor([-0.5, 0.8, 1.6, 0.1, 1.2, 0.4, -1.2, 0.0])
DRAFT_LOGITS = torch.tensor([0.1, 1.5, -0.4, 1.3, 0.7, 1.0, 0.3, -1.0])


pytestmark = pytest.mark.skipif(HAS_TRITON, reason="Triton runs the kernels themselves")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    register_rejection_kernels()


@pytest.fixture
def sampler() -> RejectionSampler:
    return RejectionSampler(Sampler())


def _sampling(temperature, *, top_k=None, top_p=None, generators=None) -> SamplingMetadata:
    temp = torch.as_tensor(temperature, dtype=torch.float32)
    batch = temp.shape[0]
    greedy = temp == 0
    return SamplingMetadata(
        temperature=temp,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=None if top_p is None else torch.as_tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.as_tensor(top_k, dtype=torch.int32),
        generators=generators or {},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _spec(draft_counts: list[int], draft_token_ids: torch.Tensor) -> SpecDecodeMetadata:
    """Logits rows per request: its draft positions, then its bonus position."""
    counts = torch.tensor(draft_counts, dtype=torch.int64)
    sampled_ends = torch.cumsum(counts + 1, 0)
    row_starts = sampled_ends - counts - 1
    owner = torch.repeat_interleave(torch.arange(len(draft_counts)), counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return SpecDecodeMetadata(
        draft_token_ids=draft_token_ids.to(torch.int32).contiguous(),
        num_draft_tokens=list(draft_counts),
        cu_num_draft_tokens=torch.cumsum(counts, 0).to(torch.int32),
        cu_num_sampled_tokens=sampled_ends.to(torch.int32),
        target_logits_indices=(row_starts[owner] + within).to(torch.int32),
        bonus_logits_indices=(sampled_ends - 1).to(torch.int32),
        logits_indices=torch.arange(int(sampled_ends[-1]), dtype=torch.int32),
    )


def _peaked(tokens: list[int]) -> torch.Tensor:
    """Logits rows whose argmax is the given token, over a little noise."""
    rows = torch.randn(len(tokens), V, generator=torch.Generator().manual_seed(7)) * 0.1
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 50.0
    return rows


def _run(sampler, drafts: list[list[int]], logits, sampling, draft_probs=None) -> torch.Tensor:
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.int32)
    spec = _spec([len(d) for d in drafts], flat)
    return sampler(spec, draft_probs, logits, sampling).sampled_token_ids


# --------------------------------------------------------------------------- registration


def test_registration_is_idempotent_and_routes_by_name():
    register_rejection_kernels()
    for name, impl in kernels._OVERRIDES.items():
        original, registered = dispatcher._registry[name]
        assert registered is impl
        assert not isinstance(original, dispatcher.KernelOverride), name  # not wrapped twice
    for owner in (rs._rejection_greedy_sample, rs._rejection_random_sample, rs._expand):
        assert isinstance(owner.kernel, dispatcher.KernelOverride)
        assert owner.kernel._forward_by_name
    assert rs._sample_recovered_tokens.kernel._forward_by_name


def test_registration_is_skipped_with_triton(monkeypatch):
    import vllm.triton_utils

    calls = []
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.setattr(dispatcher, "_registry", {})
    monkeypatch.setattr(dispatcher, "register_kernels", calls.append)
    register_rejection_kernels()
    assert calls == []


# --------------------------------------------------------------------------- greedy


def test_greedy_accepts_matching_prefix(sampler):
    argmax = [[3, 5, 1], [2, 2, 7], [4, 0, 6], [6, 1, 2], [5], []]
    bonus = [0, 4, 1, 3, 2, 6]
    drafts = [[3, 6, 1], [2, 2, 7], [1, 0, 6], [-1, 1, 2], [5], []]
    rows = []
    for a, b in zip(argmax, bonus):
        rows += a + [b]
    out = _run(sampler, drafts, _peaked(rows), _sampling([0.0] * 6))
    assert out.tolist() == [
        [3, 5, -1, -1],  # mismatch at 1: the target's argmax there, then padding
        [2, 2, 7, 4],  # all accepted: bonus appended
        [4, -1, -1, -1],  # first draft rejected
        [6, -1, -1, -1],  # a -1 draft is always rejected
        [5, 2, -1, -1],  # one draft accepted + bonus, padded to max_spec_len + 1
        [6, -1, -1, -1],  # no drafts: the bonus token alone
    ]


def test_mixed_batch_routes_rows_to_their_kernel(sampler):
    """Greedy rows follow the argmax rule, random rows the p/q rule, and each kernel leaves the
    other's rows alone: every expected row below differs under the other rule."""
    p = torch.tensor([0.4, 0.3, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    q = torch.tensor([0.9, 0.02] + [0.08 / 6] * 6)  # q(0) > p(0): may reject; q(1) < p(1): accepts
    n_greedy, n_random = 10, 3
    drafts = [[0, 0]] * n_greedy + [[1, 1]] * n_random + [[-1, 2], [0], []]
    rows, draft_probs = [], []
    for i in range(n_greedy + n_random):
        rows += [p.log(), p.log(), _peaked([5 if i < n_greedy else 6])[0]]
        draft_probs += [q, q]
    # A -1 draft is rejected even where the target is sure of token 0 (what a clamped read of
    # column -1 would see); the residual max(p - 1/V, 0) then peaks at token 0.
    rows += [_peaked([0])[0], p.log(), _peaked([6])[0]]
    draft_probs += [torch.full((V,), 1 / V), q]
    # q(d) = 0 rejects the draft (the target's argmax, which the greedy rule would accept).
    rows += [_peaked([0])[0], _peaked([6])[0]]
    draft_probs += [torch.eye(V)[1]]
    rows += [_peaked([3])[0]]  # no drafts: the bonus token alone
    temps = [0.0] * n_greedy + [1.0] * (n_random + 3)
    out = _run(sampler, drafts, torch.stack(rows), _sampling(temps), torch.stack(draft_probs))
    expected = [[0, 0, 5]] * n_greedy + [[1, 1, 6]] * n_random + [[0, -1, -1], [0, -1, -1]]
    expected.append([3, -1, -1])
    assert out.tolist() == expected


def test_synthetic_mode_kernels():
    out = torch.full((2, 4), -1, dtype=torch.int32)
    cu = torch.tensor([3, 5], dtype=torch.int32)
    draft = torch.tensor([4, 5, 6, -1, 2], dtype=torch.int32)
    argmax = torch.tensor([0, 1, 2, 3, 4])
    uniform = torch.tensor([0.1, 0.2, 0.9, 0.0, 0.1], dtype=torch.float64)
    rates = torch.tensor([0.5, 0.5, 0.5])
    kernels.rejection_greedy_sample(
        out, cu, draft, argmax, torch.tensor([[7], [7]]), None, 3, uniform, rates, True
    )
    assert out.tolist() == [[4, 5, 2, -1], [3, -1, -1, -1]]

    out = torch.full((2, 4), -1, dtype=torch.int32)
    uniform = torch.tensor([0.1, 0.9, 0.0, 0.0, 0.0], dtype=torch.float64)
    recovered = torch.tensor([1, 2, 3, 0, 0], dtype=torch.int32)
    is_greedy = torch.tensor([False, True])
    kernels.rejection_random_sample(
        out, cu, draft, None, torch.zeros(5, V), torch.tensor([[7], [7]]), recovered, uniform,
        is_greedy, 3, V, rates, True, True,
    )  # fmt: skip
    assert out.tolist() == [[4, 2, -1, -1], [-1, -1, -1, -1]]  # the greedy row is left alone


# --------------------------------------------------------------------------- expand


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_writes_in_place(dtype):
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    values = torch.tensor([0, 3, 2, 0], dtype=dtype)
    out = torch.full((6,), 99, dtype=dtype)
    kernels.expand(out, values, cu, 0, 1, 128)
    assert out.tolist() == [1, 1, 2, 2, 2, 1]
    # Through vLLM, which expands into a fresh `new_empty` tensor (temperature, top-p, top-k).
    assert rs.expand_batch_to_tokens(values + 5, cu, 6).tolist() == [5, 5, 7, 7, 7, 5]
    temps = torch.tensor([0.0, 0.7, 1.3])
    expanded = rs.expand_batch_to_tokens(temps, cu[:3], 5, replace_from=0, replace_to=1)
    assert torch.allclose(expanded, torch.tensor([1.0, 1.0, 1.3, 1.3, 1.3]))


def test_top_k_top_p_tokens_stay_in_top_k(sampler):
    """Temperature, top-p (floats) and top-k expanded per draft position, end to end."""
    batch, n = 500, 3
    logits = TARGET_LOGITS.repeat(batch * (n + 1), 1)
    drafts = torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(3))
    sampling = _sampling([0.7] * batch, top_k=[3] * batch, top_p=[0.95] * batch)
    out = _run(sampler, drafts.tolist(), logits, sampling)
    allowed = set(TARGET_LOGITS.topk(3).indices.tolist())
    emitted = set(out[out >= 0].tolist())
    assert emitted <= allowed and len(emitted) > 1
    assert (out[:, 0] >= 0).all()


# --------------------------------------------------------------------------- losslessness


def _processed(logits: torch.Tensor, temperature: float, top_k=None, top_p=None) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, -1)
    if top_k is not None:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
        probs = probs / probs.sum()
    if top_p is not None:
        ordered, order = probs.sort(descending=True)
        keep = (ordered.cumsum(0) - ordered) < top_p
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
        probs = probs / probs.sum()
    return probs


def _chi2(samples: torch.Tensor, expected: torch.Tensor) -> tuple[float, float, int]:
    """(statistic over the support, critical value at p = 0.001, samples outside the support)."""
    counts = torch.bincount(samples, minlength=V).double()
    support = expected > 0
    exp = expected[support].double() * counts.sum()
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    return stat, CHI2_CRITICAL_0001[int(support.sum()) - 1], int(counts[~support].sum())


def _trial_batch(n_drafts: int, temperature: float, with_q: bool, seed: int, **filters):
    """N_TRIALS independent requests with identical target rows; drafts fixed or sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    per_request = [TARGET_LOGITS, SECOND_LOGITS][:n_drafts] + [TARGET_LOGITS]
    logits = torch.stack(per_request).repeat(N_TRIALS, 1)
    q = torch.softmax(DRAFT_LOGITS, -1)
    if with_q:
        drafts = torch.multinomial(q, N_TRIALS * n_drafts, replacement=True, generator=gen)
        draft_probs = q.repeat(N_TRIALS * n_drafts, 1)
    else:
        drafts = torch.full((N_TRIALS * n_drafts,), 1)
        draft_probs = None
    spec = _spec([n_drafts] * N_TRIALS, drafts)
    temps = [temperature] * N_TRIALS
    top_k = None if "top_k" not in filters else [filters["top_k"]] * N_TRIALS
    top_p = None if "top_p" not in filters else [filters["top_p"]] * N_TRIALS
    sampling = _sampling(temps, top_k=top_k, top_p=top_p)
    expected = [_processed(x, temperature, **filters) for x in per_request[:n_drafts]]
    return spec, draft_probs, logits, sampling, expected


CASES = {
    "ngram": {"with_q": False},
    "draft_probs": {"with_q": True},
    "top_k": {"with_q": True, "top_k": 3},
    "top_p": {"with_q": True, "top_p": 0.8},
    "ngram_top_k": {"with_q": False, "top_k": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_first_token_follows_target(sampler, case):
    spec, draft_probs, logits, sampling, expected = _trial_batch(1, 0.7, seed=11, **CASES[case])
    out = sampler(spec, draft_probs, logits, sampling).sampled_token_ids
    stat, critical, outside = _chi2(out[:, 0].long(), expected[0])
    assert outside == 0 and stat < critical, (case, stat, outside)


def test_second_token_after_accepted_draft_follows_target(sampler):
    spec, draft_probs, logits, sampling, expected = _trial_batch(2, 0.7, with_q=True, seed=7)
    out = sampler(spec, draft_probs, logits, sampling).sampled_token_ids.long()
    stat, critical, outside = _chi2(out[:, 0], expected[0])
    assert outside == 0 and stat < critical, (stat, outside)
    accepted_first = out[:, 1] >= 0  # position 1 is written only after an accepted draft
    assert accepted_first.sum() > N_TRIALS // 3
    stat, critical, outside = _chi2(out[accepted_first, 1], expected[1])
    assert outside == 0 and stat < critical, (stat, outside)


def _broken_ratio(**kwargs):
    """Accepts a draft with probability p(d), forgetting to divide by q(d)."""
    kwargs.update(draft_probs_ptr=None, NO_DRAFT_PROBS=True)
    kernels.rejection_random_sample(**kwargs)


def _broken_residual(**kwargs):
    """Recovers from the full target distribution, without removing the rejected draft."""
    kwargs.update(draft_token_ids_ptr=torch.full_like(kwargs["draft_token_ids_ptr"], -1))
    kernels.sample_recovered_tokens(**kwargs)


@pytest.mark.parametrize(
    ("case", "owner", "broken"),
    [
        ("draft_probs", rs._rejection_random_sample, _broken_ratio),
        ("top_p", rs._rejection_random_sample, _broken_ratio),
        ("ngram", rs._sample_recovered_tokens, _broken_residual),
    ],
)
def test_chi_square_rejects_broken_rules(sampler, monkeypatch, case, owner, broken):
    """Negative control: the same statistic flags a wrong acceptance or recovery rule."""
    monkeypatch.setattr(owner.kernel, "_impl", broken)
    spec, draft_probs, logits, sampling, expected = _trial_batch(1, 0.7, seed=11, **CASES[case])
    out = sampler(spec, draft_probs, logits, sampling).sampled_token_ids
    stat, critical, _ = _chi2(out[:, 0].long(), expected[0])
    assert stat > critical, (case, stat)


# --------------------------------------------------------------------------- generators


def test_seeded_generators_reproduce(sampler):
    """Seeded rows repeat exactly, whatever the global RNG and the unseeded last row do."""
    batch, n = 7, 4
    logits = torch.zeros(n + 1, V).repeat(batch, 1)  # uniform targets: every step is random
    drafts = torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(1)).tolist()
    q = torch.softmax(DRAFT_LOGITS, -1).repeat(batch * n, 1)

    def run(seeds: list[int], global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        sampling = _sampling([1.0] * batch, generators=gens)
        return _run(sampler, drafts, logits.clone(), sampling, draft_probs=q)[: len(seeds)]

    seeds = [10, 11, 12, 13, 14, 15]
    first = run(seeds, global_seed=0)
    assert torch.equal(first, run(seeds, global_seed=1))
    assert not torch.equal(first, run([s + 100 for s in seeds], global_seed=0))
