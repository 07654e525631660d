"""MTP speculative decoding (`--speculative-config '{"method": "mtp"}'`) with the target's own MTP
layers on GLM-4.7-Flash and DeepSeek-V3 (`families/deepseek_mtp.py`: multi-head latent attention
targets, whose MTP layer keeps its latent rows in the target's latent KV-cache group, an MLA spec
named `mtp.layers.0.self_attn`) and Nemotron-H (`families/nemotron_h_mtp.py`: a Mamba-2 hybrid,
whose state layers roll back the rejected drafts). Greedy tokens and logprobs equal decoding
without speculation (transformers float32) on a mixed batch in 16-token chunks, after a prefix
hit, and for max_tokens 1 to 5; verification rows run through the same paged (latent) attention
and state path as the target's own rows.

Two MTP layers per family, both drafting on every step (`VLLM_METAL_SPEC_BACKOFF=0`): a random
one, whose drafts are nearly all rejected, and a self-drafting one (`tests.fixtures.
tiny_deepseek_mtp`, `tiny_nemotron_h_mtp`: the layer computes what the target will, so at least
90% of its drafts are accepted, which only holds if it reads the right hidden states, tokens,
positions and K/V across chunks, steps and chained drafts). With either a seeded sampled batch
gives the same tokens twice and the tokens an engine without speculation gives. The self-drafting
layer runs with async scheduling on (vLLM's default), the random one with it off, and each is
compared with the other setting, the back-off on, on the greedy and seeded batches. On
GLM-4.7-Flash a batch from a pool so small that vLLM preempts requests still gives
transformers' tokens."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    random_prompts,
    run_engine_job,
    tokens,
)
from tests.backends.mlx.runner.test_hybrid import BLOCK_SIZE as HYBRID_BLOCK_SIZE

NEW_TOKENS = 16
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(4)
]
# The attention block size: the MLA targets' configured one; Nemotron-H's, the one the platform
# picks so that a block holds a state page (`test_hybrid.BLOCK_SIZE`).
BLOCK_SIZE = {"glm4_moe_lite": 16, "deepseek_v3": 16, "nemotron_h": HYBRID_BLOCK_SIZE["nemotron_h"]}
ENGINE = {"max_num_batched_tokens": 16, "max_model_len": 160}
ENGINE_OF = {
    "glm4_moe_lite": {**ENGINE, "block_size": 16},
    "deepseek_v3": {**ENGINE, "block_size": 16},
    "nemotron_h": ENGINE,
}


def _prompts(family: str) -> list[list[int]]:
    size = BLOCK_SIZE[family]
    return random_prompts(43, [1, 9, size - 5, 2 * size + 3])


def _seeded(family: str) -> dict:
    prompts = _prompts(family)
    return {"prompts": [prompts[1], prompts[2]] * 2, "params": SEEDED_PARAMS}


@pytest.fixture(scope="module", params=["glm4_moe_lite", "deepseek_v3", "nemotron_h"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def mtp_dirs(request, family, tmp_path_factory):
    if family == "nemotron_h":
        from tests.fixtures.tiny_nemotron_h_mtp import add_mtp_step as add
    else:
        from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer as add

    src = request.getfixturevalue(f"tiny_{family}_dir")
    root = tmp_path_factory.mktemp(f"mtp-{family}")
    return {
        "random": add(src, root / "random"),
        "self_drafting": add(src, root / "self", self_drafting=True),
    }


@pytest.fixture
def plain_seeded(mtp_dirs, family, head):
    """The seeded batch decoded by the layer's target without speculation."""
    (plain,) = run_engine_job(mtp_dirs[head], [_seeded(family)], engine=ENGINE_OF[family])
    return tokens(plain)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["self_drafting", "random"])
def test_mtp_layers_give_the_tokens_of_plain_decoding(mtp_dirs, family, plain_seeded, head):
    from tests.fixtures.oracles import hf_greedy

    path, prompts, seeded = mtp_dirs[head], _prompts(family), _seeded(family)
    block_size, engine = BLOCK_SIZE[family], ENGINE_OF[family]
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    # Prompts that go on from the long ones' answers: prefix hits on the first job's blocks.
    resend = [p + o[:12] + [30, 31, 32] for p, o in zip(prompts, expected) if len(p) > block_size]
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": resend, "params": [greedy(8)]},
        {"prompts": [prompts[1]] * 5, "params": [greedy(m) for m in range(1, 6)]},
        seeded,
        seeded,
        {"action": "async_scheduling"},
    ]
    async_scheduling = head == "self_drafting"
    spec_engine = {**engine, "disable_log_stats": False, "speculative_config": SPEC}
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
    assert_logprobs_match_hf(path, prompts, batch)
    assert tokens(resent) == hf_greedy(path, resend, 8)
    assert all(r["num_cached_tokens"] >= block_size for r in resent), resent
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0, counters
    if head == "self_drafting":
        assert accepted >= 0.9 * proposed, counters
    assert len(set(map(tuple, tokens(sampled)))) > 1  # sampled, not one greedy answer
    assert tokens(sampled) == tokens(again) == plain_seeded

    # The other async setting, with the back-off on (the default: it drafts where it measures a
    # gain), gives the same greedy and seeded tokens.
    (other, other_sampled, ran_other) = run_engine_job(
        path,
        [{"prompts": prompts, "params": [greedy(NEW_TOKENS)]}, seeded,
         {"action": "async_scheduling"}],
        engine={**spec_engine, "async_scheduling": not async_scheduling},
        env={"VLLM_METAL_SPEC_BACKOFF": "1"},
    )  # fmt: skip
    assert ran_other is not async_scheduling
    assert tokens(other) == expected
    assert tokens(other_sampled) == plain_seeded


# A latent row of the tiny MLA checkpoints is 64 + 16 float32 values, in each of the 3 target
# layers and the MTP layer.
MLA_TOKEN_BYTES = 4 * (64 + 16) * 4


@pytest.mark.slow
@pytest.mark.full
def test_mla_mtp_through_preemption(tiny_glm4_moe_lite_dir, tmp_path_factory):
    """A mixed batch from a pool so small that vLLM preempts requests: the resumed requests
    recompute the MTP layer's latent rows with their prompts, and greedy tokens still equal
    transformers, with at least 90% of the self-drafting layer's drafts accepted."""
    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer

    path = add_mtp_layer(
        tiny_glm4_moe_lite_dir, tmp_path_factory.mktemp("mtp-preempt") / "self", self_drafting=True
    )
    prompts = random_prompts(21, [30, 26, 35, 1, 5])
    engine = {
        **ENGINE_OF["glm4_moe_lite"],
        "max_model_len": 96,
        # 8 blocks (7 usable: 112 tokens) for a batch that needs 16 at its longest.
        "kv_cache_memory_bytes": 8 * 16 * MLA_TOKEN_BYTES,
        "disable_log_stats": False,
        "speculative_config": SPEC,
        # Counters of the drafts themselves (under async scheduling they count placeholders).
        "async_scheduling": False,
    }
    (batch,), (counters,) = run_engine_job(
        path,
        [{"prompts": prompts, "params": [greedy(24)]}],
        engine=engine,
        with_metrics="per_job",
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )
    assert counters.get("vllm:num_preemptions", 0) >= 1, sorted(counters.items())
    assert tokens(batch) == hf_greedy(path, prompts, 24)
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0 and accepted >= 0.9 * proposed, counters
