"""Exact prefix caching on hybrid models (vLLM's "align" mamba cache mode, `kv.state`): prompts
that share prefixes with earlier requests get the same greedy tokens and logprobs with prefix
caching on as with it off, and the hits show in `num_cached_tokens` and vLLM's prefix-cache
counters. The shared prefixes end on a block boundary, inside a block, inside a prefill chunk,
past the earlier prompt's end (into what it decoded), and one prompt is sent twice. vLLM keeps
only each prompt's last boundary state by default; these engines keep every block's
(`prefix_cache_retention_interval=None`), so every boundary is a possible hit."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens
from tests.backends.mlx.runner.test_hybrid import BLOCK_SIZE

NEW_TOKENS = 12
CHUNK = 32


def _pairs(block_size: int, continuations: list[list[int]]) -> tuple[list, list, list[int]]:
    """Base prompts, the prompts sent after them, and each later prompt's shared prefix: the
    number of tokens it has in common with what its base computed (prompt and output)."""
    bs = block_size
    bases = random_prompts(31, [2 * bs + 37, 3 * bs + 5, bs + 20, 2 * bs + 1, 2 * bs + 50])
    rng = np.random.default_rng(32)
    ends = [
        bs - 3,  # short of one block: nothing to reuse
        bs,  # on a block boundary
        bs + 7,  # inside the second block
        bs + CHUNK + 5,  # inside a later prefill chunk
        2 * bs,
        2 * bs - 1,
    ]
    later, shared = [], []
    for i, base in enumerate(bases):
        for end in ends:
            if end < len(base):
                later.append(base[:end] + rng.integers(16, 700, size=9 + i).tolist())
                shared.append(end)
        # The same prompt again, and one that goes on from what the base decoded.
        later.append(list(base))
        shared.append(len(base))
        decoded = continuations[i][: NEW_TOKENS - 2]
        later.append(base + decoded + rng.integers(16, 700, size=5).tolist())
        shared.append(len(base) + len(decoded))
    return bases, later, shared


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [
        "qwen3_next",
        pytest.param("granitemoehybrid", marks=pytest.mark.full),
        pytest.param("qwen3_5", marks=pytest.mark.full),  # Qwen3-Next's layer after its projections
        pytest.param("nemotron_h", marks=pytest.mark.full),  # Granite's mixer, cacheless blocks
        pytest.param("falcon_h1", marks=pytest.mark.full),  # a mixer beside attention per layer
    ],
)
def test_prefix_hits_give_the_tokens_of_an_uncached_run(request, family):
    from tests.fixtures.oracles import hf_greedy

    model = request.getfixturevalue(f"tiny_{family}_dir")
    bs = BLOCK_SIZE[family]
    probe = random_prompts(31, [2 * bs + 37, 3 * bs + 5, bs + 20, 2 * bs + 1, 2 * bs + 50])
    bases, later, shared = _pairs(bs, hf_greedy(model, probe, NEW_TOKENS))
    assert len(later) >= 20
    jobs = [
        {"prompts": bases, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": later, "params": [greedy(NEW_TOKENS, logprobs=1)]},
    ]
    runs = {}
    for caching in (True, False):
        engine = {
            "enable_prefix_caching": caching,
            "prefix_cache_retention_interval": None,
            "max_num_batched_tokens": CHUNK,
            "max_model_len": 512,
            "disable_log_stats": False,
        }
        runs[caching] = run_engine_job(model, jobs, engine=engine, with_metrics=True)

    (on_bases, on_later), on_counters = runs[True]
    (off_bases, off_later), off_counters = runs[False]
    assert tokens(on_bases) == tokens(off_bases)
    assert tokens(on_later) == tokens(off_later)
    for on, off in zip(on_later, off_later):
        for got, want in zip(on["outputs"][0]["logprobs"], off["outputs"][0]["logprobs"]):
            assert got.keys() == want.keys()
            for token in got:
                assert abs(got[token] - want[token]) < 1e-4, (got, want)

    # A hit reuses the whole blocks of the shared prefix, at most up to the prompt's last
    # token (which is always computed).
    cached = [r["num_cached_tokens"] for r in on_later]
    expected = [bs * (min(s, len(p) - 1) // bs) for s, p in zip(shared, later)]
    assert cached == expected
    assert sum(1 for c in cached if c) >= 20
    assert [r["num_cached_tokens"] for r in off_later] == [0] * len(later)
    assert on_counters.get("vllm:prefix_cache_hits", 0) >= sum(expected)
    assert off_counters.get("vllm:prefix_cache_hits", 0) == 0
