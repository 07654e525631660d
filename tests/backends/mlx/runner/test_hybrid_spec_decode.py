"""n-gram speculative decoding on hybrid models: a request verifying drafts keeps the state after
its accepted tokens only (`kv.state_drafts`), so greedy tokens and logprobs equal decoding
without speculation (transformers float32). The prompts end a few tokens short of a block
boundary, so decoding crosses it under speculation; a second job sends prompts that go on from
what the first decoded, past that boundary: their prefix hits start from the boundary states
verification stored, and still give transformers' tokens.

A random model never continues its prompt's patterns, so its drafts are all rejected (the state
rolls back on every verification). A copy taught to continue a pattern of its prompt (then break
it, then take it up again) gets drafts accepted and rejected in one request (`full`: teaching
takes ~40 s)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens
from tests.backends.mlx.runner.test_hybrid import BLOCK_SIZE

NEW_TOKENS = 16
K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip


def _patterned(block_size: int) -> tuple[list[int], list[int]]:
    """A prompt ending 8 tokens before a block boundary, whose last 4 tokens repeat a segment
    from earlier in it, and the answer taught for it: the rest of the segment (drafts accepted),
    3 other tokens (drafts rejected), the segment's start again (accepted)."""
    rng = np.random.default_rng(5)
    r = rng.integers(16, 700, size=block_size - 20).tolist()
    seg = rng.integers(16, 700, size=8).tolist()
    other = rng.integers(16, 700, size=3).tolist()
    half = len(r) // 2
    return r[:half] + seg + r[half:] + seg[:4], seg[4:] + other + seg[:5]


def _taught(model_dir, family: str, tmp_path_factory):
    """`model_dir` taught `_patterned`'s answer for its family's block size."""
    from tests.fixtures.teach import teach

    prompt, answer = _patterned(BLOCK_SIZE[family])
    out = tmp_path_factory.mktemp(f"taught-{family}") / family
    teach(model_dir, out, [prompt], answer)
    return out


@pytest.fixture(scope="module")
def taught_qwen3_next(tiny_qwen3_next_dir, tmp_path_factory):
    return _taught(tiny_qwen3_next_dir, "qwen3_next", tmp_path_factory)


@pytest.fixture(scope="module")
def taught_qwen3_5(tiny_qwen3_5_causal_lm_dir, tmp_path_factory):
    return _taught(tiny_qwen3_5_causal_lm_dir, "qwen3_5", tmp_path_factory)


def _continuations(prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """The first job's long prompts followed by 12 of their decoded tokens (past the boundary)
    and a tail the model did not write."""
    long = [(p, o) for p, o in zip(prompts, outputs) if len(p) > 20]
    return {"prompts": [p + o[:12] + [30, 31, 32] for p, o in long], "params": [greedy(8)]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "taught"),
    [
        ("tiny_qwen3_next_dir", False),
        pytest.param("taught_qwen3_next", True, marks=pytest.mark.full),
        pytest.param("tiny_granitemoehybrid_dir", False, marks=pytest.mark.full),
        pytest.param("tiny_qwen3_5_dir", False, marks=pytest.mark.full),
        pytest.param("taught_qwen3_5", True, marks=pytest.mark.full),
        pytest.param("tiny_nemotron_h_dir", False, marks=pytest.mark.full),
        pytest.param("tiny_falcon_h1_dir", False, marks=pytest.mark.full),
    ],
)
def test_ngram_on_a_hybrid_gives_the_tokens_of_plain_decoding(request, model, taught):
    from tests.backends.mlx.runner.jobs import assert_logprobs_match_hf
    from tests.fixtures.oracles import hf_greedy

    path = request.getfixturevalue(model)
    family = next(
        (f for f in ("granitemoehybrid", "nemotron_h", "falcon_h1") if f in model), "qwen3_next"
    )
    bs = BLOCK_SIZE[family]
    patterned, answer = _patterned(bs)
    prompts = [patterned, *random_prompts(41, [1, 9, bs - 5])]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    if taught:
        assert expected[0][: len(answer)] == answer
    resend = _continuations(prompts, expected)
    jobs = [{"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]}, resend]
    engine = {
        "max_num_batched_tokens": 32,
        "prefix_cache_retention_interval": None,  # keep every boundary state
        "disable_log_stats": False,
        "speculative_config": SPEC,
    }
    (drafted, resent), counters = run_engine_job(
        path,
        jobs,
        engine=engine,
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},  # draft on every step, whatever it costs
    )

    assert tokens(drafted) == expected
    assert_logprobs_match_hf(path, prompts, drafted)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    assert proposed > 0, counters
    if taught:
        assert 0 < accepted < proposed, counters

    assert tokens(resent) == hf_greedy(path, resend["prompts"], 8)
    cached = [r["num_cached_tokens"] for r in resent]
    assert all(c >= bs for c in cached), cached
