"""MTP speculative decoding (`--speculative-config '{"method": "mtp"}'`, the target's own head:
`spec_decode/mtp.py`) on Qwen3.5, a hybrid target: greedy tokens and logprobs equal decoding
without speculation (transformers float32) on a mixed batch in 32-token chunks, after a prefix
hit, and for max_tokens 1 to 5.

Two heads, both drafting on every step (`VLLM_METAL_SPEC_BACKOFF=0`): a random one, whose drafts
are nearly all rejected, so the target's state layers roll back on most verifications, and a
self-drafting one (`tests.fixtures.tiny_qwen3_5_mtp`: the head computes what the target will, so
at least 90% of its drafts are accepted, which only holds if the head reads the right hidden
states, tokens and positions across chunks, steps and chained drafts). With either head a
seeded sampled batch gives the same tokens twice and the tokens an engine without speculation
gives.

The self-drafting head runs with async scheduling on (vLLM's default): each step is scheduled
before the previous one is sampled, and the runner puts its drafts in for the scheduler's
placeholders and corrects the positions after rejections; its acceptance holds there too. The
random head runs with it off. (The back-off with MTP runs in the `mtp` benchmark suite's quick
test.)"""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    COMPILED_ENV,
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.backends.mlx.runner.test_hybrid import BLOCK_SIZE

NEW_TOKENS = 16
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(4)
]


@pytest.fixture(scope="module")
def mtp_dirs(tiny_qwen3_5_causal_lm_dir, tmp_path_factory):
    from tests.fixtures.tiny_qwen3_5_mtp import add_mtp_head

    root = tmp_path_factory.mktemp("mtp")
    return {
        "random": add_mtp_head(tiny_qwen3_5_causal_lm_dir, root / "random"),
        "self_drafting": add_mtp_head(
            tiny_qwen3_5_causal_lm_dir, root / "self", self_drafting=True
        ),
    }


ENGINE = {"max_num_batched_tokens": 32}
BS = BLOCK_SIZE["qwen3_5"]
PROMPTS = random_prompts(43, [1, 9, BS - 5, 2 * BS + 3])
SEEDED = {"prompts": [PROMPTS[1], PROMPTS[2]] * 2, "params": SEEDED_PARAMS}


@pytest.fixture
def plain_seeded(mtp_dirs, head):
    """The seeded batch decoded by the head's target without speculation."""
    (plain,) = run_engine_job(mtp_dirs[head], [SEEDED], engine=ENGINE)
    return tokens(plain)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["self_drafting", "random"])
def test_mtp_gives_the_tokens_of_plain_decoding(mtp_dirs, plain_seeded, head):
    from tests.fixtures.oracles import hf_greedy

    path = mtp_dirs[head]
    prompts = PROMPTS
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    # Prompts that go on from the long ones' answers: prefix hits on the first job's blocks.
    resend = [p + o[:12] + [30, 31, 32] for p, o in zip(prompts, expected) if len(p) > BS]
    short = prompts[1]
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": resend, "params": [greedy(8)]},
        {"prompts": [short] * 5, "params": [greedy(m) for m in range(1, 6)]},
        SEEDED,
        SEEDED,
        {"action": "async_scheduling"},
    ]
    # The self-drafting head's engine compiles (MLX's GPU default; in-process): its decode steps
    # and its head's chained draft steps (`spec_decode/chain.py`), which must keep its drafts
    # accepted; after sleep level 2 (the weights reloaded) the chains are traced afresh, not
    # run on traces holding the weights let go.
    async_scheduling = compiled = head == "self_drafting"
    chains = {"action": "compiled_chains"}
    if compiled:
        jobs += [chains, {"action": "chain_traces"}, {"action": "queued_proposals"},
                 {"action": "sleep_wake"}, jobs[0], chains]  # fmt: skip
    (batch, resent, shorts, sampled, again, ran_async, *woken), per_job = run_engine_job(
        path,
        jobs,
        engine={**ENGINE, "disable_log_stats": False, "speculative_config": SPEC,
                "async_scheduling": async_scheduling, "enable_sleep_mode": compiled},
        with_metrics="per_job",
        # Draft on every step, whatever it costs.
        env={"VLLM_METAL_SPEC_BACKOFF": "0", **(COMPILED_ENV if compiled else {})},
    )  # fmt: skip
    counters = per_job[2]  # after the greedy jobs (sampled requests reject drafts by chance)

    assert ran_async is async_scheduling
    if compiled:
        before, traces, (queued, dropped), _, again_batch, after = woken
        # A trace per chain length and padded shape, replayed: positions, slots and tables
        # are its inputs, not constants of one step.
        assert 0 < traces < before / 4, (traces, before)
        # The proposals after the batch's uniform verifying steps were queued on the device
        # behind them (`spec_decode/ahead.py`), none dropped: the MTP head's drafts and their
        # acceptance below are partly theirs.
        assert queued > 0 and dropped == 0, (queued, dropped, before)
        assert tokens(again_batch) == expected
        # Counted afresh after the wake-up: no more than all the jobs before the sleep ran.
        assert 0 < after <= before, (before, after)
    assert tokens(batch) == expected
    assert_logprobs_match_hf(path, prompts, batch)
    assert tokens(resent) == hf_greedy(path, resend, 8)
    assert all(r["num_cached_tokens"] >= BS for r in resent), resent
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0, counters
    if head == "self_drafting":
        assert accepted >= 0.9 * proposed, counters
    assert len(set(map(tuple, tokens(sampled)))) > 1  # sampled, not one greedy answer
    assert tokens(sampled) == tokens(again) == plain_seeded
