"""EAGLE-3 speculative decoding (`--speculative-config '{"method": "eagle3", "model": HEAD}'`,
`spec_decode/eagle3.py`) on a tiny Qwen3 target: greedy tokens and logprobs equal decoding without
speculation (transformers float32) on a mixed batch in 32-token chunks, after a prefix hit, and for
max_tokens 1 to 5; a seeded sampled batch gives the same tokens twice and the tokens an engine
without speculation gives.

Four heads (`tests/fixtures/tiny_eagle3.py`), drafting on every step (`VLLM_METAL_SPEC_BACKOFF=0`):
a self-drafting one over a target whose next token depends on the current one alone (at least 90% of
its drafts accepted, which only holds if the head reads the right tokens and positions across
chunks, steps and chained drafts); a leaky one, whose hidden states (the target's aux states, its
own outputs) and draft vocabulary make only some drafts right (two: as `Eagle3LlamaForCausalLM` and
as `Eagle3Qwen3ForCausalLM`), whose accepted drafts per position equal those of vLLM's own CPU
backend running the same head (the aux states, `fc`, the chained hidden states and `d2t` then agree
with vLLM's); and a random head with a draft vocabulary over an ordinary target. The leaky and
random heads run with async scheduling on (vLLM's default; there the runner does not cap drafts at
the remaining max_tokens, so vLLM's CPU backend drafts alike), the self-drafting one with it off
(and on in the CI case). With the back-off on (the default), the leaky head's seeded batch is still
the same twice and without speculation, and the random head's paused requests leave their head
passes for later (`spec_decode/head.py`): every draft they make after a pause, and after a
prefix hit on blocks they completed while paused, is the draft the head gives at the same tokens
when every step drafts.
"""

from __future__ import annotations

import json
import shutil

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


def spec(head) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def eagle3_dirs(tiny_model_dir, tmp_path_factory):
    """head name -> (target, head) checkpoint directories."""
    from tests.fixtures.tiny_eagle3 import self_drafting_target, write_eagle3_head

    root = tmp_path_factory.mktemp("eagle3")
    plain = tiny_model_dir("qwen3", **TARGET)
    target = self_drafting_target(plain, root / "target")
    return {
        "self_drafting": (target, write_eagle3_head(target, root / "self", self_drafting=True)),
        "leaky": (
            target,
            write_eagle3_head(
                target, root / "leaky", self_drafting=True, leak=0.1, even_vocabulary=True
            ),
        ),
        "leaky_qwen3": (
            target,
            write_eagle3_head(
                target,
                root / "leaky_qwen3",
                arch="qwen3",
                self_drafting=True,
                leak=0.1,
                even_vocabulary=True,
            ),
        ),
        "random": (plain, write_eagle3_head(plain, root / "random")),
    }


def test_self_drafting_head_is_accepted_and_exact(eagle3_dirs):
    """The CI case: one engine, greedy batch and max_tokens 1..5 equal transformers; under
    async scheduling vLLM's counters show every draft accepted, also beside a seeded request
    with logprobs, which may not draft: the placeholders vLLM scheduled for it are named
    invalid (`request_state._report_unfilled`), not counted as drafts rejected."""
    from tests.fixtures.oracles import hf_greedy

    target, head = eagle3_dirs["self_drafting"]
    expected = hf_greedy(target, PROMPTS, NEW_TOKENS)
    no_drafts = {"max_tokens": NEW_TOKENS, "temperature": 0.8, "seed": 1, "logprobs": 1}
    jobs = [
        {"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]},
        {"prompts": [PROMPTS[1]] * 5, "params": [greedy(m) for m in range(1, 6)]},
        {"prompts": PROMPTS[:2], "params": [greedy(NEW_TOKENS), no_drafts]},
        {"action": "async_scheduling"},
    ]
    (batch, shorts, beside, ran_async), counters = run_engine_job(
        target,
        jobs,
        engine={**ENGINE, "disable_log_stats": False, "speculative_config": spec(head)},
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},
    )
    assert ran_async is True
    assert tokens(batch) == expected
    assert tokens(shorts) == [expected[1][:m] for m in range(1, 6)]
    assert tokens(beside)[0] == expected[0]
    proposed = counters["vllm:spec_decode_num_draft_tokens"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens"]
    assert proposed > 0 and accepted == proposed, counters


def test_drafts_after_a_pause_are_those_of_drafting_every_step(eagle3_dirs):
    """The CI case of the head's deferred passes. The random head's drafts are rejected, so
    with the back-off on its requests pause for 4, 8, 16 steps; its attention reads its K/V at
    every earlier position, so a draft equals the every-step engine's at the same tokens only
    if the head caught up over the positions it left (and, after the prefix hits, ran over the
    blocks completed while paused). The paused engine compiles its decode steps
    (`VLLM_METAL_COMPILE=1`): the aux states the head catches up over come from the traces, and
    its chained draft steps run through the head's compiled chain (`spec_decode/chain.py`), whose
    drafts must be the eager chain's."""
    target, head = eagle3_dirs["random"]
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
        {"action": "compiled_chains"},
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
    # Steps after which nobody drafts hand their tokens to the next step on the device, the
    # head's bookkeeping done before they reach the host (`SpecDecoder.plan_ahead`).
    assert runs["on"][5] > 20, runs["on"][5]
    assert runs["off"][6] == 0 and runs["on"][6] > 0, (runs["off"][6], runs["on"][6])
    every = {tuple(c): d for c, d in runs["off"][3]}
    for _, batch, resent, _, _, _, _ in runs.values():
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


@pytest.mark.parametrize("head_name", ["leaky", "random"])
def test_drafts_queued_behind_the_verifying_step_are_those_proposed_after_it(
    eagle3_dirs, head_name
):
    """Where the target's steps compile, a head's proposal after a step that verifies drafts
    on the device is queued behind that step (`spec_decode/ahead.py`): its first draft is read
    at the row of each request's last accepted draft, counted on the device, and the next step
    takes the step's tokens and those drafts on the device, its positions shifted there by the
    drafts rejected. The leaky head's drafts are accepted only in part, so that row moves (its
    target's attention adds nothing, so positions do not show); the random head's are nearly
    all rejected over an ordinary target, whose tokens follow only at the right positions.
    Tokens and every draft list must be the eager engine's (host proposals, steps built after
    the previous one's tokens reach the host) at the same context, every step drafting."""
    target, head = eagle3_dirs[head_name]
    jobs = [
        {"action": "record_drafts"},
        {"prompts": PROMPTS, "params": [greedy(32)]},
        {"action": "recorded_drafts"},
        {"action": "queued_proposals"},
        {"action": "carried_steps"},
    ]
    engine = {**ENGINE, "speculative_config": spec(head)}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_METAL_SPEC_BACKOFF": "0"}
    eager, queued_run = (
        run_engine_job(target, jobs, engine=engine, env={**env, "VLLM_METAL_COMPILE": c,
                                                         "VLLM_METAL_DRAFTS_AHEAD": c})
        for c in ("0", "1")
    )  # fmt: skip
    _, eager, eager_drafts, eager_queued, eager_carried = eager
    _, ahead, ahead_drafts, (queued, dropped), carried = queued_run
    assert tokens(ahead) == tokens(eager)
    assert eager_queued == [0, 0] and dropped == 0, (eager_queued, dropped)
    # Verifying steps whose tokens and drafts the next step took on the device, its positions
    # shifted there by the drafts rejected (`ahead.CarriedDrafts`); none where steps are eager.
    assert eager_carried == 0 and carried >= queued / 2, (eager_carried, carried, queued)
    # Most draft lists (one per request and step) came from a queued proposal.
    assert queued * len(PROMPTS) >= len(ahead_drafts) / 2, (queued, len(ahead_drafts))
    every = {tuple(c): d for c, d in eager_drafts}
    assert {tuple(c) for c, _ in ahead_drafts} == set(every)
    for context, drafts in ahead_drafts:
        assert drafts == every[tuple(context)], context


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3_moe", "gpt_oss"])
def test_other_targets_give_the_tokens_of_plain_decoding(tiny_model_dir, tmp_path, arch):
    """The other target families vLLM defines EAGLE-3 for (`eagle3.TARGET_TYPES`), each with a
    random head drafting on every step: greedy tokens equal an engine's without speculation
    (GPT-OSS: windowed and full layers, sinks; the tiny Mistral without its window, since a
    target with no full-attention layer is refused)."""
    from tests.fixtures.tiny_eagle3 import write_eagle3_head
    from tests.models.test_eagle3 import _target

    target = _target(tiny_model_dir, arch, tmp_path)
    if arch == "mistral":
        config = json.loads((target / "config.json").read_text())
        config["sliding_window"] = None
        target = tmp_path / "mistral-full"
        shutil.copytree(_target(tiny_model_dir, arch, tmp_path), target)
        (target / "config.json").write_text(json.dumps(config))
    head = write_eagle3_head(target, tmp_path / "head")
    jobs = [{"prompts": PROMPTS, "params": [greedy(NEW_TOKENS)]}]
    (plain,), (drafted,), metrics = plain_and_drafted(target, jobs, spec(head), ENGINE)
    assert tokens(drafted) == tokens(plain)
    assert metrics.get("vllm:spec_decode_num_draft_tokens", 0) > 0, metrics


@pytest.fixture
def plain_seeded(eagle3_dirs, head):
    """The seeded batch decoded by the head's target without speculation."""
    (plain,) = run_engine_job(eagle3_dirs[head][0], [SEEDED], engine=ENGINE)
    return tokens(plain)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["self_drafting", "leaky", "leaky_qwen3", "random"])
def test_eagle3_gives_the_tokens_of_plain_decoding(eagle3_dirs, plain_seeded, head):
    from tests.fixtures.oracles import hf_greedy

    target, head_dir = eagle3_dirs[head]
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
    async_scheduling = head != "self_drafting"
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
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0, counters
    if head == "self_drafting":
        assert accepted >= 0.9 * proposed, counters
    if head.startswith(
        "leaky"
    ):  # some drafts right, some wrong, each as vLLM's CPU backend has them
        assert 0 < accepted < proposed, counters
        cpu_engine = {**engine, "gpu_memory_utilization": 0.3}
        (cpu_batch,), cpu = run_engine_job(
            target, jobs[:1], engine=cpu_engine, backend="cpu", with_metrics="per_job"
        )
        assert tokens(cpu_batch) == expected
        ours = per_job[0]
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens_per_pos"):
            key = f"vllm:spec_decode_{name}"
            assert ours[key] == cpu[0][key], (ours, cpu[0])


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("head", ["leaky"])
def test_seeded_batches_with_the_backoff_on(eagle3_dirs, plain_seeded, head):
    """With the back-off deciding from measured times which steps draft, a seeded batch still
    gives the same tokens twice and the tokens of decoding without speculation."""
    target, head_dir = eagle3_dirs[head]
    sampled, again = run_engine_job(
        target,
        [SEEDED, SEEDED],
        engine={**ENGINE, "speculative_config": spec(head_dir)},
        env={"VLLM_METAL_SPEC_BACKOFF": "1"},
    )
    assert tokens(sampled) == tokens(again) == plain_seeded
