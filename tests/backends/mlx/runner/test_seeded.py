"""Seeded randomness by position (`runner/seeded.py`): the generator seed of (seed, position) is
deterministic and unrelated for neighbouring seeds and positions, and tokens vLLM's own `Sampler`
draws with it over many seeds follow the sampled distribution (a keyed stream that repeated, or
leaned towards some tokens, would fail the chi-square test). The engine-level promise (a seeded
request gives the tokens of decoding without drafts) is tested in `test_spec_decode.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import Sampler

from vllm_metal.backends.mlx.runner.seeded import (
    drafts_by_position,
    position_seed,
    sampling_metadata,
)


def test_position_seed_is_deterministic_and_spread():
    seeds = {position_seed(s, p) for s in range(64) for p in range(64)}
    assert len(seeds) == 64 * 64
    assert all(0 <= s < 2**63 for s in seeds)
    assert position_seed(7, 100) == position_seed(7, 100)
    assert position_seed(-1, 0) != position_seed(0, 0)
    # Neighbouring keys differ in about half their bits.
    flips = [(position_seed(3, p) ^ position_seed(3, p + 1)).bit_count() for p in range(200)]
    assert 24 < np.mean(flips) < 40


def test_keyed_samples_follow_the_distribution():
    """Tokens drawn with vLLM's Sampler, one (seed, position) generator per row, over 3000 seeds
    at one position, against the probabilities of the logits after temperature."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    n = 3000
    generators = {}
    for s in range(n):
        generator = torch.Generator()
        generator.manual_seed(position_seed(s, 11))
        generators[s] = generator
    metadata = sampling_metadata(torch.full((n,), 0.9), generators)
    drawn = Sampler()(logits.repeat(n, 1), metadata).sampled_token_ids.view(-1).numpy()
    expected = torch.softmax(logits / 0.9, -1).numpy() * n
    observed = np.bincount(drawn, minlength=len(logits))
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = torch.tensor((len(logits) - 1) / 2.0)
    pvalue = float(torch.special.gammaincc(dof, torch.tensor(stat / 2.0)))
    assert pvalue > 1e-3, (observed, expected)
    # The same generators give the same tokens again.
    for s, generator in generators.items():
        generator.manual_seed(position_seed(s, 11))
    again = Sampler()(logits.repeat(n, 1), metadata).sampled_token_ids.view(-1).numpy()
    assert (again == drawn).all()


@pytest.mark.parametrize(
    ("params", "by_position"),
    [
        (SamplingParams(temperature=0.8, top_k=3, top_p=0.9, seed=1), True),
        (SamplingParams(temperature=0.8, seed=1, presence_penalty=0.5), False),
        (SamplingParams(temperature=0.8, seed=1, min_p=0.1), False),
        (SamplingParams(temperature=0.8, seed=1, logprobs=2), False),
        (SamplingParams(temperature=0.8, seed=1, logit_bias={3: 1.0}), False),
        (SamplingParams(temperature=0.8, seed=1, min_tokens=2), False),
        (SamplingParams(temperature=0.8), False),  # unseeded: the rejection sampler's
        (SamplingParams(temperature=0.0, seed=1), False),  # greedy
    ],
)
def test_which_seeded_requests_draft(params, by_position):
    assert drafts_by_position(params) is by_position
