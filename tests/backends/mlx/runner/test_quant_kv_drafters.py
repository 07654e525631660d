"""Quantized KV caches beside drafters with KV of their own: a draft model, an EAGLE-3 head and
Qwen3.5's MTP head (over a hybrid target, whose state pages stay float). As vLLM 0.32's draft
layers inherit `--kv-cache-dtype`, the drafter's pages take the target's format
(`kv.quant.draft_cache_config`), TurboQuant's skip list included.

Under one quantized cache, greedy tokens with speculation equal those without; a drafter that
computes what its target computes (the target as its own draft model, self-drafting EAGLE-3 and
MTP heads) has nearly all its drafts accepted (EAGLE-3's self-drafting head, which only
approximates its target, at least 90%), which only holds if it reads its own pages in the target's
format."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens

pytestmark = [pytest.mark.slow, pytest.mark.full]

NEW_TOKENS = 16
ENGINE = {"max_num_batched_tokens": 32, "async_scheduling": False}
# Draft on every step, whatever it costs (the back-off decides from step times).
ENV = {"VLLM_METAL_SPEC_BACKOFF": "0"}
FORMATS = ["fp8", "int8_per_token_head", "int4_per_token_head"]
TURBOQUANT = ["turboquant_k8v4", "turboquant_3bit_nc"]
# Six layers: under TurboQuant vLLM keeps layers 0, 1, 4 and 5 at the model's dtype.
NUM_LAYERS = 6
# A drafter that is its target over the same pages (the target as its own draft model, the MTP
# head that computes what the target will): measured 1.000 of ~44 drafts accepted for every
# format; one rejection (a near-tie decided the other way in another batch shape) is allowed.
# The same drafter keeping float pages beside an fp8 target was measured at 0.935, beside an
# int4 one at 0.673.
EXACT_ACCEPTANCE = 0.97


def _compare(model, prompts, spec: dict, dtype: str) -> tuple[float, int]:
    """Run `prompts` greedily with and without `spec` under the `dtype` cache; assert equal
    tokens and return the share of drafts accepted and the number proposed."""
    jobs = [{"prompts": prompts, "params": [greedy(NEW_TOKENS)]}]
    engine = {**ENGINE, "kv_cache_dtype": dtype}
    (plain,) = run_engine_job(model, jobs, engine=engine)
    engine = {**engine, "speculative_config": spec, "disable_log_stats": False}
    (drafted,), counters = run_engine_job(model, jobs, engine=engine, with_metrics=True, env=ENV)
    assert tokens(drafted) == tokens(plain)
    proposed = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert proposed > 0, counters
    return accepted / proposed, proposed


@pytest.mark.parametrize("dtype", FORMATS + TURBOQUANT)
def test_draft_model_pages_take_the_targets_format(tiny_model_dir, dtype) -> None:
    """Under TurboQuant the draft's layers 0, 1, 4 and 5 keep the model's dtype, as the target's
    do (vLLM's skip list names layers by the index in their module names)."""
    model = tiny_model_dir("qwen3", num_layers=NUM_LAYERS)
    prompts = random_prompts(71, [1, 9, 27, 45])
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    share, proposed = _compare(model, prompts, spec, dtype)
    print(f"draft model {dtype}: {share:.3f} of {proposed} drafts accepted")
    assert share >= EXACT_ACCEPTANCE


# The self-drafting EAGLE-3 head's share of drafts accepted. Its output is the value row of the
# positions its attention picks, so a quantized value moves it: over TurboQuant pages (4-bit
# values) measured 0.840 of 50 for turboquant_4bit_nc and turboquant_k8v4 alike, 1.000 with the
# head's pages kept float beside the same target; fp8 and int8 rows stay above 0.9.
EAGLE3_ACCEPTANCE = {"fp8": 0.9, "int8_per_token_head": 0.9, "turboquant_4bit_nc": 0.75}


@pytest.mark.parametrize("dtype", list(EAGLE3_ACCEPTANCE))
def test_eagle3_head_pages_take_the_targets_format(tiny_model_dir, tmp_path, dtype) -> None:
    """Under TurboQuant the head's layer (vLLM numbers it after the target's) stores slots,
    though the target's two layers are all boundary layers at the model's dtype."""
    from tests.backends.mlx.runner.test_eagle3 import TARGET
    from tests.fixtures.tiny_eagle3 import self_drafting_target, write_eagle3_head

    target = self_drafting_target(tiny_model_dir("qwen3", **TARGET), tmp_path / "target")
    head = write_eagle3_head(target, tmp_path / "head", self_drafting=True)
    prompts = random_prompts(72, [1, 9, 27, 45])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    share, proposed = _compare(target, prompts, spec, dtype)
    print(f"eagle3 {dtype}: {share:.3f} of {proposed} drafts accepted")
    assert share >= EAGLE3_ACCEPTANCE[dtype]


@pytest.mark.parametrize("dtype", ["fp8", "int8_per_token_head", "turboquant_k3v4_nc"])
def test_mtp_head_of_a_hybrid_takes_the_targets_format(
    tiny_qwen3_5_causal_lm_dir, tmp_path, dtype
) -> None:
    """Qwen3.5's own MTP head: the target's attention pages and the head's in the format, the
    Gated DeltaNet states float (and rolled back on rejections)."""
    from tests.fixtures.tiny_qwen3_5_mtp import add_mtp_head

    model = add_mtp_head(tiny_qwen3_5_causal_lm_dir, tmp_path / "self", self_drafting=True)
    prompts = random_prompts(73, [1, 9, 40, 75])
    share, proposed = _compare(
        model, prompts, {"method": "mtp", "num_speculative_tokens": 3}, dtype
    )
    print(f"mtp {dtype}: {share:.3f} of {proposed} drafts accepted")
    assert share >= EXACT_ACCEPTANCE
