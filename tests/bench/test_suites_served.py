"""Proves the engine-case suites (LoRA, speculative decoding, pooling, KV offload, hybrid prefix
caching) and the served suites (speech, vision) run end to end (`python -m bench.run SUITE
--quick`) and write their results: one `slow` test per suite on its own engine or server, and a
`full` test per suite with peers (`--quick --peers`) for what only the comparison shows.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOT_MEASURED = "not measured"


# ----------------------------------------------------------------------- engine-case suites


def _lora_common(data: dict) -> None:
    from bench.suites.lora import TARGETS

    for name, case in data["cases"].items():
        assert case["median_tpot_ms"] > 0, name
        assert case["output_tok_s"] > 0, name
        assert case["concurrency"] == len(case["adapters"]), name
    split = data["cases"]["lora_split_c8"]["adapters"]
    assert split.count(0) == split.count(1) == 4
    assert len(data["settings"]["adapters"]) == 2
    for path in data["settings"]["adapters"]:
        assert (Path(path) / "adapter_config.json").is_file()
    assert data["ops"], "no op micro-benchmark case"
    for op in data["ops"]:
        for key in ("base_ms", "stacked_update_ms", "gather_update_ms", "stacked_total_ms",
                    "gather_total_ms"):  # fmt: skip
            assert op[key] > 0, (op, key)
    assert set(data["summary"]["targets"]) == set(TARGETS)


@pytest.mark.slow
@pytest.mark.full
def test_lora_quick(run_suite) -> None:
    run = run_suite("lora")
    data = run.results()
    _lora_common(data)
    assert set(data["cases"]) == {"lora_split_c8"}
    summary = data["summary"]
    assert all(v is None for v in summary["ratios"].values())
    assert all(v is None for v in summary["checks"].values())
    assert summary["targets"]["lora_step_time_vs_base"]["measured"] is None
    text = run.report("lora", ("## Targets", "## Ratios (same run)", "## Engine cases",
                               "## One projection"))  # fmt: skip
    assert "lora_step_time_vs_base" in text and "Measured on" in text and NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_lora_with_peers(run_suite) -> None:
    from bench.suites.lora import cases

    run = run_suite("lora", peers=True)
    data = run.results()
    _lora_common(data)
    assert set(data["cases"]) == {c["name"] for c in cases()}
    summary = data["summary"]
    for key, value in summary["ratios"].items():
        assert value is not None and value > 0, key
    assert summary["targets"]["lora_step_time_vs_base"]["measured"] == pytest.approx(
        data["cases"]["lora_split_c8"]["median_tpot_ms"]
        / data["cases"]["base_c8"]["median_tpot_ms"],
        abs=1e-3,
    )
    # The wrapping with no adapter in the step leaves the base model's projections untouched.
    assert summary["checks"]["wrapping_keeps_base_tokens"]
    run.report("lora", ("## Targets", "## Ratios (same run)"))


@pytest.mark.slow
@pytest.mark.full  # CI's budget: test_spec_decode.py runs the spec-decode engines in CI
def test_spec_decode_quick(run_suite) -> None:
    run = run_suite("spec_decode")
    data = run.results()
    assert set(data["cases"]) == {"ngram_repetitive"}
    case = data["cases"]["ngram_repetitive"]
    assert case["median_tpot_ms"] > 0 and case["output_tok_s"] > 0
    assert case["spec"]["method"] == "ngram" and "num_drafts" in case["spec_counters"]
    assert data["summary"]["speedups"]["ngram_repetitive_tpot_speedup"] is None
    assert NOT_MEASURED in run.report()


@pytest.mark.slow
@pytest.mark.full
def test_spec_decode_profile_splits_steps_and_a_heads_proposals(run_suite) -> None:
    run = run_suite(
        "spec_decode", False, "--cases", "eagle3_self_drafting", "--profile", "--output-len", "48"
    )
    phases = run.results()["cases"]["eagle3_self_drafting"]["phases"]
    verify = [k for k in phases["kinds"] if k.startswith("verify")]
    assert verify and all(phases["kinds"][k]["steps"] > 0 for k in verify)
    # Every drafting call ran the head's first pass over at least one row per drafting request.
    drafting = {k: v for k, v in phases["drafts"].items() if k.endswith(", drafting")}
    assert drafting and sum(v["steps"] for v in drafting.values()) >= 10
    assert all(v["median_ms"] > 0 for v in drafting.values())
    assert "A head's proposals by its first pass" in run.report()


@pytest.mark.slow
@pytest.mark.full  # CI's budget: test_mtp.py runs MTP engines in CI
def test_mtp_quick(run_suite) -> None:
    run = run_suite("mtp")
    data = run.results()
    assert set(data["cases"]) == {"mtp_self_drafting_c1"}
    case = data["cases"]["mtp_self_drafting_c1"]
    assert case["median_tpot_ms"] > 0 and case["output_tok_s"] > 0
    assert case["spec"]["method"] == "mtp" and case["spec_counters"]["num_drafts"] > 0
    # The self-drafting head's drafts are accepted where it drafts. (Under async scheduling, the
    # engine's default, vLLM also counts the placeholders of the steps the back-off did not
    # draft on as drafts; tests/backends/mlx/runner/test_mtp.py holds its acceptance to 90%.)
    assert case["spec_counters"]["num_accepted_tokens"] >= 2
    assert data["summary"]["speedups"] == {}  # no plain peer in --quick
    assert "mtp_self_drafting_c1" in run.report()


@pytest.mark.slow
@pytest.mark.full
def test_spec_decode_with_peers(run_suite) -> None:
    from bench.suites.spec_decode import QUICK_CASES

    run = run_suite("spec_decode", peers=True)
    data = run.results()
    assert set(data["cases"]) == set(QUICK_CASES)
    for name, case in data["cases"].items():
        assert case["median_tpot_ms"] > 0 and case["output_tok_s"] > 0, name
    speedups = data["summary"]["speedups"]
    assert speedups["ngram_repetitive_tpot_speedup"] > 0
    assert speedups["draft_repetitive_tpot_speedup"] > 0
    assert data["summary"]["targets"]
    run.report()


def _pooling_cases(data: dict) -> None:
    for name, case in data["cases"].items():
        assert case["inputs_per_s"] > 0, name
        assert case["median_call_s"] > 0, name
        assert case["calls"] == data["settings"][f"b{min(case['batch'], 32)}_calls"], name
        assert case["tokens_per_input"]["min"] >= data["settings"]["input_tokens"], name
    for kind, model in data["models"].items():
        assert model["workers"]["plugin"]["platform"] == "MetalPlatform", kind


@pytest.mark.slow
@pytest.mark.full
def test_pooling_quick(run_suite) -> None:
    from bench.suites.pooling import BATCHES, cases

    run = run_suite("pooling")
    data = run.results()
    want = {c["name"] for c in cases() if c["model"] == "decoder" and c["backend"] == "plugin"}
    assert set(data["cases"]) == want and len(want) == len(BATCHES)
    _pooling_cases(data)
    assert set(data["models"]) == {"decoder"}
    assert data["models"]["decoder"]["agreement"] is None
    assert data["summary"]["ratios"] == {} and data["summary"]["agreement_passed"] == {}
    text = run.report("pooling", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases",
                                  "## Workers"))  # fmt: skip
    assert "Measured on" in text and "Quick run" in text and NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_pooling_with_peers(run_suite) -> None:
    from bench.suites.pooling import BACKENDS, BATCHES, MODELS, cases

    run = run_suite("pooling", peers=True)
    data = run.results()
    assert set(data["cases"]) == {c["name"] for c in cases()}
    assert len(data["cases"]) == len(MODELS) * len(BATCHES) * len(BACKENDS)
    _pooling_cases(data)
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    for kind, model in data["models"].items():
        assert model["workers"]["cpu"]["platform"] == "CpuPlatform", kind
        check = model["agreement"]
        assert check["passed"], (kind, check)
        assert check["min_cosine"] >= 0.999, kind
        assert check["same_token_counts"], kind
        assert check["inputs"] == max(BATCHES), kind
    ratios = data["summary"]["ratios"]
    assert set(ratios) == {f"{m}_b{b}_plugin_vs_cpu" for m in MODELS for b in BATCHES}
    assert all(r > 0 for r in ratios.values())
    assert all(data["summary"]["agreement_passed"].values())
    text = run.report("pooling", ("## Plugin / vLLM CPU (same run)", "## Agreement"))
    assert "Measured on" in text and "Quick run" in text


def _kv_offload_cases(data: dict, cases: set[str]) -> None:
    assert data["problems"] == []
    assert set(data["cases"]) == cases
    for name, case in data["cases"].items():
        assert case["median_ttft_s"] > 0, name
        assert case["engine_start_s"] and all(s > 0 for s in case["engine_start_s"]), name


@pytest.mark.slow
@pytest.mark.full
def test_kv_offload_quick(run_suite) -> None:
    run = run_suite("kv_offload")
    data = run.results()
    _kv_offload_cases(data, {"host", "disk"})
    assert all(c["vs_recomputed"] is None for c in data["cases"].values())
    full = data["settings"]["input_len"] // 16 * 16
    assert data["cases"]["host"]["num_cached_tokens"] == [full] * data["settings"]["repeats"]
    assert data["cases"]["disk"]["num_cached_tokens"] == [full]
    assert NOT_MEASURED in run.report()


@pytest.mark.slow
@pytest.mark.full
def test_kv_offload_with_peers(run_suite) -> None:
    from bench.suites.kv_offload import CASES

    run = run_suite("kv_offload", peers=True)
    data = run.results()
    _kv_offload_cases(data, set(CASES))
    assert data["cases"]["recomputed"]["vs_recomputed"] == 1
    run.report()


def _hybrid_prefix_requests(data: dict) -> dict:
    """The Qwen3-Next requests, after checking the hits with caching on: none for a cold P, P's
    last block boundary before its last token for a re-sent or extended one."""
    assert data["problems"] == []
    family = data["families"]["qwen3_next"]
    block = family["workers"]["on"]["block_size"]
    hit = (data["settings"]["input_len"] - 1) // block * block
    requests = family["requests"]
    assert 0 < hit < data["settings"]["input_len"]
    for request, want in (("cold", 0), ("resent", hit), ("extended", hit)):
        on = requests[request]["on"]
        assert on["num_cached_tokens"] == [want] * data["settings"]["repeats"], request
        assert on["median_ttft_s"] > 0, request
    return requests


@pytest.mark.slow
@pytest.mark.full
def test_hybrid_prefix_quick(run_suite) -> None:
    run = run_suite("hybrid_prefix")
    data = run.results()
    requests = _hybrid_prefix_requests(data)
    assert all("off" not in by for by in requests.values())
    assert all(s["on_vs_off"] is None for s in data["summary"]["qwen3_next"].values())
    text = run.report("hybrid_prefix", ("## Qwen3-Next",))
    assert "Measured on" in text and "Quick run" in text and NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_hybrid_prefix_with_peers(run_suite) -> None:
    run = run_suite("hybrid_prefix", peers=True)
    data = run.results()
    requests = _hybrid_prefix_requests(data)
    for request, by in requests.items():
        assert by["off"]["num_cached_tokens"] == [0] * data["settings"]["repeats"], request
        summary = data["summary"]["qwen3_next"][request]
        assert summary["on_vs_off"] > 0
        # Caching changes no token.
        assert summary["tokens_identical"] == data["settings"]["repeats"], request
    run.report("hybrid_prefix", ("## Qwen3-Next",))


# --------------------------------------------------------------------------- served suites


def _speech_cases(data: dict) -> None:
    from bench.suites.speech import QUICK_CLIP

    seconds = data["clip"]["seconds"]
    assert seconds == QUICK_CLIP["seconds"]
    for name, case in data["cases"].items():
        n = case["concurrency"]
        assert case["rounds"] == data["settings"][f"c{n}_rounds"], name
        assert len(case["latency_s"]) == n * case["rounds"], name
        assert case["rtf"] == pytest.approx(case["median_round_wall_s"] / (n * seconds)), name
        assert case["audio_s_per_s"] == pytest.approx(1 / case["rtf"]), name
        # (round_wall_s is rounded to the millisecond)
        assert 0 < case["median_latency_s"] <= case["max_latency_s"]
        assert case["max_latency_s"] <= max(case["round_wall_s"]) + 1e-3, name
        assert case["tokens_per_request"] == [QUICK_CLIP["max_tokens"]] * case["rounds"], name
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    check = data["agreement"]
    assert check["passed"], check
    assert all(check["matches_reference"].values())
    assert not check["reference"]["stopped_at_eos"]
    assert check["reference"]["num_tokens"] == QUICK_CLIP["max_tokens"]
    assert check["text"].strip()


@pytest.mark.slow
@pytest.mark.full
def test_speech_quick(run_suite) -> None:
    from bench.suites.speech import CONCURRENCY, cases

    run = run_suite("speech")
    data = run.results()
    assert set(data["cases"]) == {c["name"] for c in cases() if c["backend"] == "plugin"}
    _speech_cases(data)
    assert set(data["servers"]) == {"plugin"}
    assert data["summary"]["ratios"] == {f"c{n}_plugin_vs_cpu": None for n in CONCURRENCY}
    check = data["agreement"]
    assert check["identical_across_backends"] is None
    assert check["distinct_texts"] == {"plugin": 1}
    text = run.report("speech", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases",
                                 "## Servers"))  # fmt: skip
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
    assert NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_speech_with_peers(run_suite) -> None:
    from bench.suites.speech import BACKENDS, CONCURRENCY, cases

    run = run_suite("speech", peers=True)
    data = run.results()
    assert set(data["cases"]) == {c["name"] for c in cases()}
    _speech_cases(data)
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in CONCURRENCY}
    assert all(r > 0 for r in data["summary"]["ratios"].values())
    assert set(data["summary"][f"c{max(CONCURRENCY)}_vs_c1"]) == set(BACKENDS)
    check = data["agreement"]
    assert check["identical_across_backends"]
    assert check["distinct_texts"] == {be: 1 for be in BACKENDS}
    text = run.report("speech", ("## Plugin / vLLM CPU (same run)", "## Agreement"))
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text


def _vision_cases(data: dict) -> None:
    from bench.suites.vision import QUICK_CASE

    max_tokens = QUICK_CASE["max_tokens"]
    for name, case in data["cases"].items():
        n = case["concurrency"]
        assert case["rounds"] == data["settings"][f"c{n}_rounds"], name
        assert len(case["requests"]) == n * case["rounds"], name
        assert case["tokens_per_request"] == [max_tokens], name
        assert case["server_generated_tokens"] == [n * max_tokens] * case["rounds"], name
        for request in case["requests"]:
            assert 0 < request["ttft_s"] < request["latency_s"], name
            assert request["decode_tok_s"] > 0, name
            assert request["usage_completion_tokens"] == max_tokens, name
        assert case["median_ttft_ms"] <= case["max_ttft_ms"], name
        assert case["min_decode_tok_s"] <= case["median_decode_tok_s"], name
    # Every request had an image of its own.
    seeds = [s for ss in data["workload"]["image_seeds"].values() for s in ss]
    assert len(seeds) == len(set(seeds))
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    check = data["agreement"]
    assert check["passed"], check
    assert all(check["every_request_full_length"].values())
    # The images decide the answers: different images, different tokens.
    assert check["distinct_answers"] > 1


@pytest.mark.slow
@pytest.mark.full
def test_vision_quick(run_suite) -> None:
    from bench.suites.vision import cases

    run = run_suite("vision")
    data = run.results()
    assert set(data["cases"]) == {c["name"] for c in cases() if c["backend"] == "plugin"}
    _vision_cases(data)
    assert set(data["servers"]) == {"plugin"}
    assert all(v is None for v in data["summary"]["ratios"].values())
    assert data["agreement"]["identical_across_backends"] is None
    text = run.report("vision", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases",
                                 "## Servers"))  # fmt: skip
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
    assert NOT_MEASURED in text


@pytest.mark.slow
@pytest.mark.full
def test_vision_with_peers(run_suite) -> None:
    from bench.suites.vision import BACKENDS, CONCURRENCY, cases

    run = run_suite("vision", peers=True)
    data = run.results()
    assert set(data["cases"]) == {c["name"] for c in cases()}
    _vision_cases(data)
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    ratios = data["summary"]["ratios"]
    assert ratios["ttft_plugin_vs_cpu"] > 0
    assert all(ratios[f"decode_c{n}_plugin_vs_cpu"] > 0 for n in CONCURRENCY)
    check = data["agreement"]
    assert check["identical_across_backends"] and check["first_difference"] is None
    assert check["every_request_full_length"] == {be: True for be in BACKENDS}
    text = run.report("vision", ("## Plugin / vLLM CPU (same run)", "## Agreement"))
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
