"""MTP speculative decoding with Gemma 4's assistant (`--speculative-config '{"method": "mtp",
"model": ASSISTANT}'`: `spec_decode/assistant.py`) on the tiny Gemma 4 (sliding and full layers in
KV-cache groups of their own, layers reading earlier layers' K/V, per-layer inputs): greedy
tokens and logprobs equal transformers float32 on a mixed batch prefilled in 16-token chunks
past the sliding window, after a prefix hit, and for max_tokens 1 to 5.

Three assistants (`tests.fixtures.tiny_gemma4_mtp`):
- self-drafting (the assistant computes what the target will), with async scheduling and the
  back-off on (the defaults): at least 90% of its drafts are accepted, a seeded sampled batch
  gives the same tokens twice and the tokens an engine without speculation gives, the
  assistant's weights count in the worker's memory figures, and after sleep level 2 it makes the
  same drafts at the same tokens;
- a noisy self-drafting one, drafting on every step (`VLLM_METAL_SPEC_BACKOFF=0`, async
  scheduling off), whose drafts
  depend on the target's hidden states and K/V it reads and are accepted less than half the
  time: the engine accepts exactly as many drafts as transformers' modules draft right for each
  request, which only holds if the assistant reads the right token, hidden state, position and
  pages at every step and chains its drafts as vLLM does;
- (`full`) a random one with ordered embeddings (the centroid-masked head), drafting on every
  step: nearly every draft rejected.
(`full`) Over an fp8 or int4 per-token-head KV cache the noisy one's greedy tokens equal that
engine's without speculation.
"""

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
K = 3
BLOCK_SIZE = 16
# vLLM's hits land on its scheduler block, the least common multiple of the groups' block sizes
# (the full layers' 16 tokens, the sliding layers' narrower rows 32), and with a drafter that
# reads hidden states it keeps only the prompt's last whole such block but one: a prompt of
# 2 x 32 + 6 tokens leaves a hit of 32 for a longer prompt sharing it.
SCHEDULER_BLOCK = 32
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(4)
]
ENGINE = {"max_num_batched_tokens": 16, "block_size": BLOCK_SIZE, "max_model_len": 128}
ACCEPTANCE = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _tensor_bytes(checkpoint) -> int:
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", framework="numpy") as f:
        return sum(f.get_tensor(name).nbytes for name in f.keys())  # noqa: SIM118


def right_drafts(recorded: list, prompts: list, outputs: list) -> tuple[int, int]:
    """(right, checked) of the recorded drafts ([tokens it follows, drafts]) against the
    requests' tokens: each draft list counts up to its first draft that differs from the token
    at its place, as a verification accepts them; drafts past a request's last token are not
    checked."""
    sequences = [p + o for p, o in zip(prompts, outputs)]
    right = checked = 0
    for context, drafts in recorded:
        (sequence,) = [s for s in sequences if s[: len(context)] == context[: len(s)]]
        # Under async scheduling a request may compute tokens past max_tokens, which vLLM drops.
        for j, draft in enumerate(drafts[: max(0, len(sequence) - len(context))]):
            checked += 1
            if draft != sequence[len(context) + j]:
                break
            right += 1
    return right, checked


@pytest.fixture(scope="module")
def pairs(tiny_gemma4_dir, tmp_path_factory):
    """name -> (target, assistant)."""
    from tests.fixtures.tiny_gemma4_mtp import write_assistant, write_self_drafting_pair

    root = tmp_path_factory.mktemp("gemma4-mtp")
    return {
        "self_drafting": write_self_drafting_pair(tiny_gemma4_dir, root / "self"),
        # Seed 3: the oracle's drafts win by 0.014 in logit at least, far above the float32
        # drift between MLX and torch (~3e-4), so the exact count below is no coin toss.
        "noisy": write_self_drafting_pair(tiny_gemma4_dir, root / "noisy", seed=3, noise=0.02),
        "random": (
            tiny_gemma4_dir,
            write_assistant(tiny_gemma4_dir, root / "random", ordered=True),
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "assistant", ["self_drafting", "noisy", pytest.param("random", marks=pytest.mark.full)]
)
def test_mtp_assistant_gives_the_tokens_of_plain_decoding(pairs, assistant):
    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.tiny_gemma4_mtp import TorchDrafts

    target, drafter = pairs[assistant]
    prompts = random_prompts(43, [1, 9, 11, 2 * SCHEDULER_BLOCK + 6])
    expected = hf_greedy(target, prompts, NEW_TOKENS)
    # Prompts that go on from the long one's answer: a prefix hit on the first job's blocks.
    resend = [p + o[:12] + [30, 31, 32] for p, o in zip(prompts, expected) if len(p) > BLOCK_SIZE]
    short = prompts[1]
    seeded = {"prompts": [prompts[1], prompts[2]] * 2, "params": SEEDED_PARAMS}
    first = {"prompts": prompts, "params": [greedy(NEW_TOKENS, logprobs=1)]}
    jobs = [
        first,
        {"prompts": resend, "params": [greedy(8)]},
        {"prompts": [short] * 5, "params": [greedy(m) for m in range(1, 6)]},
        seeded,
        seeded,
    ]
    spec = {"method": "mtp", "model": str(drafter), "num_speculative_tokens": K}
    engine = {**ENGINE, "disable_log_stats": False, "speculative_config": spec}
    self_drafting = assistant == "self_drafting"
    if self_drafting:
        # Async scheduling and the back-off on (the defaults). Each draft is recorded in-process
        # and checked against transformers' tokens: under async scheduling vLLM counts the
        # placeholders the runner had no draft for, and drafts verified past max_tokens, as
        # rejected. Then the weights, sleep level 2, and the first job again.
        record, recorded = {"action": "record_drafts"}, {"action": "recorded_drafts"}
        jobs = [{"action": "async_scheduling"}, record, first, recorded, *jobs[1:], recorded,
                {"action": "memory_usage"}, {"action": "sleep_wake"}, first, recorded]  # fmt: skip
        engine["enable_sleep_mode"] = True
        env = {"VLLM_METAL_SPEC_BACKOFF": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    else:
        # Every step drafts, as the oracle's count assumes; async scheduling off, where drafts
        # stop one short of max_tokens as the oracle's do.
        engine["async_scheduling"] = False
        env = {"VLLM_METAL_SPEC_BACKOFF": "0"}
    results, per_job = run_engine_job(target, jobs, engine=engine, with_metrics="per_job", env=env)
    if self_drafting:
        ran_async, _, batch, drafts, resent, shorts, sampled, again, _, memory, _, woken, woken_drafts = results  # fmt: skip
        assert ran_async is True
    else:
        batch, resent, shorts, sampled, again = results
    assert tokens(batch) == expected
    assert_logprobs_match_hf(target, prompts, batch)
    assert tokens(resent) == hf_greedy(target, resend, 8)
    assert all(r["num_cached_tokens"] >= SCHEDULER_BLOCK for r in resent), resent
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]

    proposed, accepted = (per_job[0].get(k, 0) for k in ACCEPTANCE)  # the first job alone
    assert proposed > 0, per_job[0]
    if self_drafting:
        right, checked = right_drafts(drafts, prompts, expected)
        assert right >= 0.9 * checked > 0, (right, checked)
        plain, plain_memory = run_engine_job(
            target, [seeded, {"action": "memory_usage"}], engine=ENGINE
        )
        assert len(set(map(tuple, tokens(sampled)))) > 1  # sampled, not one greedy answer
        assert tokens(sampled) == tokens(again) == tokens(plain)
        # The assistant's weights count in the worker's figures, and come back after sleep:
        # the same drafts at the same tokens, accepted as before. Which steps draft depends on
        # the back-off's timings, so the contexts drafted at both times are fewer on a loaded
        # machine (9 of 21 once); a few of them tell the weights apart.
        assert memory[0]["weights"] - plain_memory[0]["weights"] == _tensor_bytes(drafter)
        assert tokens(woken) == expected
        before = {tuple(c): d for c, d in drafts}
        common = [(c, d) for c, d in woken_drafts if tuple(c) in before]
        assert len(common) >= 4, (len(common), len(woken_drafts))
        assert all(d == before[tuple(c)] for c, d in common)
        right, checked = right_drafts(woken_drafts, prompts, expected)
        assert right >= 0.9 * checked > 0, (right, checked)
    elif assistant == "noisy":
        oracle = TorchDrafts(target, drafter)
        counts = [oracle.accepted(p, o, K) for p, o in zip(prompts, expected)]
        assert (proposed, accepted) == tuple(map(sum, zip(*counts))), (per_job[0], counts)
        assert 0 < accepted < proposed


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head", "turboquant_k8v4"])
def test_mtp_assistant_over_a_quantized_cache(pairs, dtype):
    """The assistant keeps no K/V, so it drafts over a quantized cache too, reading the target's
    pages (the noisy assistant's drafts depend on them; per-token-head pages of the two head
    sizes padded to one size): greedy tokens equal a quantized engine's without speculation, and
    drafts are accepted."""
    target, drafter = pairs["noisy"]
    jobs = [{"prompts": random_prompts(44, [5, 20, 40]), "params": [greedy(NEW_TOKENS)]}]
    engine = {**ENGINE, "kv_cache_dtype": dtype}
    (plain,) = run_engine_job(target, jobs, engine=engine)
    spec = {"method": "mtp", "model": str(drafter), "num_speculative_tokens": K}
    (drafted,), metrics = run_engine_job(
        target,
        jobs,
        engine={**engine, "speculative_config": spec, "disable_log_stats": False},
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )
    assert tokens(drafted) == tokens(plain)
    proposed, accepted = (metrics.get(k, 0) for k in ACCEPTANCE)
    assert 0 < accepted < proposed, metrics
