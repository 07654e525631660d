"""DFlash speculative decoding (`--speculative-config '{"method": "dflash", "model": HEAD}'`,
`spec_decode/dflash.py`) on a tiny Qwen3 target: greedy tokens and logprobs equal decoding without
speculation (transformers float32) on a mixed batch in 32-token chunks, after a prefix hit, and for
max_tokens 1 to 5; a seeded sampled batch gives the same tokens twice and the tokens an engine
without speculation gives; async scheduling on gives the tokens of async scheduling off.

Three heads (`tests/fixtures/tiny_dflash.py`): a self-drafting one over a target that decodes
a, a^1, a, ... (at least 90% of its drafts accepted on prompts that already follow that rule,
which only holds if every step's context K/V sit at the right positions and each block's bonus
row and masks are where vLLM's proposer puts them); a leaky one, the same with noise, whose
drafts proposed and accepted per position equal those of vLLM's own CPU backend running the
same head; and a random non-causal head with a draft vocabulary over an ordinary target, drafting
every step (`VLLM_METAL_SPEC_BACKOFF=0`), and with the back-off on for the seeded batches.
"""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import (
    assert_logprobs_match_hf,
    greedy,
    plain_and_drafted,
    random_prompts,
    run_engine_job,
    tokens,
)

NEW_TOKENS = 16
BS = 16
TARGET = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 2, "head_dim": 64}
PROMPTS = random_prompts(43, [1, 9, BS - 5, 2 * BS + 3])
ENGINE = {"max_num_batched_tokens": 32}
SEEDED_PARAMS = [
    {"max_tokens": 16, "temperature": 0.8, "top_k": 3, "seed": 40 + i, "ignore_eos": True}
    for i in range(4)
]
SEEDED = {"prompts": [PROMPTS[1], PROMPTS[2]] * 2, "params": SEEDED_PARAMS}
LEAK = 0.05  # the leaky head's noise: about half its drafts right (22, 8, 8 of 27 per position)


def spec(head) -> dict:
    # The self-drafting head reads 3 positions back: 3 masks (see tiny_dflash).
    return {"method": "dflash", "model": str(head), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def dflash_dirs(tiny_model_dir, tmp_path_factory):
    """head name -> (target, head) checkpoint directories."""
    from tests.fixtures.tiny_dflash import pairing_target, write_dflash_head

    root = tmp_path_factory.mktemp("dflash")
    plain = tiny_model_dir("qwen3", **TARGET)
    pairing = pairing_target(plain, root / "pairing")
    return {
        "self_drafting": (
            pairing,
            write_dflash_head(pairing, root / "self", self_drafting=True),
        ),
        "leaky": (
            pairing,
            write_dflash_head(pairing, root / "leaky", self_drafting=True, leak=LEAK),
        ),
        "random": (plain, write_dflash_head(plain, root / "random")),
    }


@pytest.mark.slow
@pytest.mark.full
def test_self_drafting_head_is_accepted_and_exact(dflash_dirs):
    """Greedy batch and max_tokens 1..5 equal transformers; >= 90% of the drafts accepted,
    async scheduling on."""
    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.tiny_dflash import pairing_prompts

    target, head = dflash_dirs["self_drafting"]
    prompts = pairing_prompts([3, 9, BS - 5, 2 * BS + 3])
    expected = hf_greedy(target, prompts, NEW_TOKENS)
    jobs = [
        {"prompts": prompts, "params": [greedy(NEW_TOKENS)]},
        {"prompts": [prompts[1]] * 5, "params": [greedy(m) for m in range(1, 6)]},
        {"action": "async_scheduling"},
    ]
    (batch, shorts, ran_async), counters = run_engine_job(
        target,
        jobs,
        engine={**ENGINE, "disable_log_stats": False, "speculative_config": spec(head)},
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )
    assert ran_async is True
    assert tokens(batch) == expected
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    proposed = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted >= 0.9 * proposed, counters


@pytest.mark.slow
@pytest.mark.full
def test_leaky_head_drafts_as_vllms_cpu_backend(dflash_dirs):
    """The leaky head on random prompts (the first drafts after each prompt read prompt tokens,
    and the noise flips others): tokens equal vLLM's CPU backend running the same head, and so
    do the drafts proposed and accepted, position by position."""
    target, head = dflash_dirs["leaky"]
    jobs = [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]}]
    engine = {**ENGINE, "disable_log_stats": False, "speculative_config": spec(head)}
    (ours,), per_job = run_engine_job(
        target, jobs, engine=engine, with_metrics="per_job", env={"VLLM_METAL_SPEC_BACKOFF": "0"}
    )
    (cpu,), cpu_per_job = run_engine_job(
        target,
        jobs,
        engine={**engine, "gpu_memory_utilization": 0.3},
        backend="cpu",
        with_metrics="per_job",
    )
    assert tokens(ours) == tokens(cpu)
    accepted = per_job[0]["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert 0 < sum(accepted) < per_job[0]["vllm:spec_decode_num_draft_tokens"], per_job[0]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens_per_pos"):
        key = f"vllm:spec_decode_{name}"
        assert per_job[0][key] == cpu_per_job[0][key], (per_job[0], cpu_per_job[0])


@pytest.fixture
def plain_seeded(dflash_dirs, head):
    """The seeded batch decoded by the head's target without speculation."""
    (plain,) = run_engine_job(dflash_dirs[head][0], [SEEDED], engine=ENGINE)
    return tokens(plain)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["random"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_dflash_gives_the_tokens_of_plain_decoding(
    dflash_dirs, plain_seeded, head, async_scheduling
):
    from tests.fixtures.oracles import hf_greedy

    target, head_dir = dflash_dirs[head]
    expected = hf_greedy(target, PROMPTS, NEW_TOKENS)
    resend = [p + o[:12] + [30, 31, 32] for p, o in zip(PROMPTS, expected) if len(p) > BS]
    jobs = [
        {"prompts": PROMPTS, "params": [greedy(NEW_TOKENS, logprobs=1)]},
        {"prompts": resend, "params": [greedy(8)]},
        {"prompts": [PROMPTS[1]] * 5, "params": [greedy(m) for m in range(1, 6)]},
        SEEDED,
        SEEDED,
        {"action": "async_scheduling"},
    ]
    engine = {**ENGINE, "disable_log_stats": False, "speculative_config": spec(head_dir),
              "async_scheduling": async_scheduling}  # fmt: skip
    (batch, resent, shorts, sampled, again, ran_async), per_job = run_engine_job(
        target, jobs, engine=engine, with_metrics="per_job", env={"VLLM_METAL_SPEC_BACKOFF": "0"}
    )
    assert ran_async is async_scheduling
    assert tokens(batch) == expected
    assert_logprobs_match_hf(target, PROMPTS, batch)
    assert tokens(resent) == hf_greedy(target, resend, 8)
    assert all(r["num_cached_tokens"] >= BS for r in resent), resent
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    assert len(set(map(tuple, tokens(sampled)))) > 1  # sampled, not one greedy answer
    assert tokens(sampled) == tokens(again) == plain_seeded
    counters = per_job[2]  # after the greedy jobs
    assert counters.get("vllm:spec_decode_num_draft_tokens", 0) > 0, counters


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["random"])
def test_seeded_batches_with_the_backoff_on(dflash_dirs, plain_seeded, head):
    """With the back-off deciding from measured times which steps draft, a seeded batch still
    gives the same tokens twice and the tokens of decoding without speculation."""
    target, head_dir = dflash_dirs[head]
    sampled, again = run_engine_job(
        target,
        [SEEDED, SEEDED],
        engine={**ENGINE, "speculative_config": spec(head_dir)},
        env={"VLLM_METAL_SPEC_BACKOFF": "1"},
    )
    assert tokens(sampled) == tokens(again) == plain_seeded


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "gpt_oss"])
def test_other_targets_give_the_tokens_of_plain_decoding(tiny_model_dir, tmp_path, arch):
    """The other target families whose aux states the runner keeps (`dflash.TARGET_TYPES`, as
    for EAGLE-3), each with a random head drafting on every step: greedy tokens equal an
    engine's without speculation (GPT-OSS: windowed and full layers, sinks)."""
    from tests.fixtures.tiny_dflash import write_dflash_head
    from tests.models.test_eagle3 import _target

    target = _target(tiny_model_dir, arch, tmp_path)
    head = write_dflash_head(target, tmp_path / "head")
    jobs = [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]}]
    (plain,), (drafted,), metrics = plain_and_drafted(target, jobs, spec(head), ENGINE)
    assert tokens(drafted) == tokens(plain)
    assert metrics.get("vllm:spec_decode_num_draft_tokens", 0) > 0, metrics


@pytest.mark.slow
@pytest.mark.full
def test_requests_near_max_model_len_give_the_tokens_of_plain_decoding(dflash_dirs):
    """A query block reaches k + 1 positions past a request's last token: within that of
    `max_model_len` the request stops drafting (its block would have no KV blocks), and its
    tokens stay those of decoding without speculation up to the end."""
    target, head = dflash_dirs["random"]
    engine = {**ENGINE, "max_model_len": 128}
    jobs = [{"prompts": random_prompts(5, [100, 118, 121]), "params": [greedy(30)]}]
    (plain,), (drafted,), metrics = plain_and_drafted(target, jobs, spec(head), engine)
    assert [len(t) for t in tokens(plain)] == [28, 10, 7]  # cut by max_model_len
    assert tokens(drafted) == tokens(plain)
    assert metrics.get("vllm:spec_decode_num_draft_tokens", 0) > 0, metrics


@pytest.mark.slow
@pytest.mark.full
def test_drafts_after_a_pause_are_those_of_drafting_every_step(dflash_dirs):
    """The random head's drafts are rejected, so with the back-off on its requests pause; the
    paused engine compiles its decode steps (`VLLM_METAL_COMPILE=1`, MLX's GPU default), whose
    traces return the aux states the context is written from. A draft reads the context K/V at
    every earlier position, so it equals the every-step engine's at the same tokens only if the
    context was written over the paused steps too (and, after the prefix hits, sits in the
    blocks the cache hands over); steps after which nobody drafts have their context written
    before their tokens reach the host."""
    target, head = dflash_dirs["random"]
    first = {"prompts": PROMPTS, "params": [greedy(48)]}
    (expected,) = run_engine_job(target, [first], engine=ENGINE)
    resend = [p + o[:40] + [30, 31, 32] for p, o in zip(PROMPTS, tokens(expected))]
    jobs = [
        {"action": "record_drafts"},
        first,
        {"prompts": resend, "params": [greedy(16)]},
        {"action": "recorded_drafts"},
        {"action": "compiled_steps"},
        {"action": "carried_steps"},
    ]
    engine = {**ENGINE, "speculative_config": spec(head)}
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    runs = {
        backoff: run_engine_job(target, jobs, engine=engine, env={**in_process, **env})
        for backoff, env in (
            ("off", {"VLLM_METAL_SPEC_BACKOFF": "0", "VLLM_METAL_COMPILE": "0"}),
            ("on", {"VLLM_METAL_SPEC_BACKOFF": "1", "VLLM_METAL_COMPILE": "1"}),
        )
    }
    assert runs["off"][4] == 0 and runs["on"][4] > 20, (runs["off"][4], runs["on"][4])
    # Steps after which nobody drafted, whose context was written before their tokens reached
    # the host (`DFlashDrafter.keeps_up`), their tokens carried on the device.
    assert runs["on"][5] > 0, runs["on"][5]
    every = {tuple(c): d for c, d in runs["off"][3]}
    for _, batch, resent, _, _, _ in runs.values():
        assert tokens(batch) == tokens(expected)
        assert all(r["num_cached_tokens"] >= BS for r in resent), resent
    paused = runs["on"][3]
    contexts = {tuple(c) for c, _ in paused}
    prompts = {len(p) for p in PROMPTS + resend}
    after_a_pause = 0
    for context, drafts in paused:
        assert drafts == every[tuple(context)][: len(drafts)], context
        if tuple(context[:-1]) not in contexts and len(context) - 1 not in prompts:
            after_a_pause += 1
    assert len(paused) < len(every) and after_a_pause >= len(PROMPTS), (len(paused), after_a_pause)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("dtype", ["fp8", "int4_per_token_head"])
def test_self_drafting_head_over_a_quantized_cache(dflash_dirs, dtype):
    """The head's pages take the target's format and its block reads them both ways: greedy
    tokens equal an engine's with the same cache and no drafts, and the self-drafting head,
    which reads its context rows back, keeps >= 90% of its drafts (all 48 of 48 measured)."""
    from tests.fixtures.tiny_dflash import pairing_prompts

    target, head = dflash_dirs["self_drafting"]
    jobs = [
        {"prompts": pairing_prompts([3, 9, BS - 5, 2 * BS + 3]), "params": [greedy(NEW_TOKENS)]}
    ]
    engine = {**ENGINE, "kv_cache_dtype": dtype}
    (plain,), (drafted,), counters = plain_and_drafted(target, jobs, spec(head), engine)
    assert tokens(drafted) == tokens(plain)
    proposed = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted >= 0.9 * proposed, counters
