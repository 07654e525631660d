"""MTP speculative decoding (`--speculative-config '{"method": "mtp"}'`) on multi-head latent
attention targets with their own MTP layer (`families/deepseek_mtp.py`): GLM-4.7-Flash and
DeepSeek-V3. Greedy tokens and logprobs equal decoding without speculation (transformers float32)
on a mixed batch in 16-token chunks, after a prefix hit, and for max_tokens 1 to 5; the MTP
layer's latent rows live in the target's latent KV-cache group (an MLA spec, `mtp.layers.0.
self_attn`), and the verification rows run through the same paged latent attention as the
target's own rows.

Two MTP layers, both drafting on every step (`VLLM_METAL_SPEC_BACKOFF=0`): a random one, whose
drafts are nearly all rejected, and a self-drafting one (`tests.fixtures.tiny_deepseek_mtp`: the
layer computes what the target will, so at least 90% of its drafts are accepted, which only holds
if it reads the right hidden states, tokens, positions and latent rows across chunks, steps and
chained drafts). With either a seeded sampled batch gives the same tokens twice and the tokens an
engine without speculation gives. The self-drafting layer runs with async scheduling on (vLLM's
default), the random one with it off, and each is compared with the other setting on the greedy
batch."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)

NEW_TOKENS = 16
BLOCK_SIZE = 16
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(4)
]
ENGINE = {"max_num_batched_tokens": 16, "block_size": BLOCK_SIZE, "max_model_len": 128}
PROMPTS = random_prompts(43, [1, 9, BLOCK_SIZE - 5, 2 * BLOCK_SIZE + 3])
SEEDED = {"prompts": [PROMPTS[1], PROMPTS[2]] * 2, "params": SEEDED_PARAMS}


@pytest.fixture(scope="module", params=["glm4_moe_lite", "deepseek_v3"])
def mla_mtp_dirs(request, tmp_path_factory):
    from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer

    src = request.getfixturevalue(f"tiny_{request.param}_dir")
    root = tmp_path_factory.mktemp(f"mtp-{request.param}")
    return {
        "random": add_mtp_layer(src, root / "random"),
        "self_drafting": add_mtp_layer(src, root / "self", self_drafting=True),
    }


@pytest.fixture
def plain_seeded(mla_mtp_dirs, head):
    """The seeded batch decoded by the layer's target without speculation."""
    (plain,) = run_engine_job(mla_mtp_dirs[head], [SEEDED], engine=ENGINE)
    return tokens(plain)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["self_drafting", "random"])
def test_mla_mtp_gives_the_tokens_of_plain_decoding(mla_mtp_dirs, plain_seeded, head):
    from tests.fixtures.oracles import hf_greedy

    path = mla_mtp_dirs[head]
    expected = hf_greedy(path, PROMPTS, NEW_TOKENS)
    # Prompts that go on from the long ones' answers: prefix hits on the first job's blocks.
    resend = [p + o[:12] + [30, 31, 32] for p, o in zip(PROMPTS, expected) if len(p) > BLOCK_SIZE]
    jobs = [
        {"prompts": PROMPTS, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": resend, "params": [greedy(8)]},
        {"prompts": [PROMPTS[1]] * 5, "params": [greedy(m) for m in range(1, 6)]},
        SEEDED,
        SEEDED,
        {"action": "async_scheduling"},
    ]
    async_scheduling = head == "self_drafting"
    spec_engine = {**ENGINE, "disable_log_stats": False, "speculative_config": SPEC}
    (batch, resent, shorts, sampled, again, ran_async), per_job = run_engine_job(
        path,
        jobs,
        engine={**spec_engine, "async_scheduling": async_scheduling},
        with_metrics="per_job",
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},  # draft on every step, whatever it costs
    )
    counters = per_job[2]  # after the greedy jobs (sampled requests reject drafts by chance)

    assert ran_async is async_scheduling
    assert tokens(batch) == expected
    assert_logprobs_match_hf(path, PROMPTS, batch)
    assert tokens(resent) == hf_greedy(path, resend, 8)
    assert all(r["num_cached_tokens"] >= BLOCK_SIZE for r in resent), resent
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0, counters
    if head == "self_drafting":
        assert accepted >= 0.9 * proposed, counters
    assert len(set(map(tuple, tokens(sampled)))) > 1  # sampled, not one greedy answer
    assert tokens(sampled) == tokens(again) == plain_seeded

    # The other async setting gives the same greedy and seeded tokens.
    (other, other_sampled, ran_other) = run_engine_job(
        path,
        [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]}, SEEDED,
         {"action": "async_scheduling"}],
        engine={**spec_engine, "async_scheduling": not async_scheduling},
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )  # fmt: skip
    assert ran_other is not async_scheduling
    assert tokens(other) == expected
    assert tokens(other_sampled) == plain_seeded
