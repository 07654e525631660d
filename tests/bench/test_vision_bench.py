"""Proves `python -m bench.vision --quick` runs every case and writes vision.json, vision.md and
vision.png.

Everything runs for real on the tests' tiny Idefics3: one `vllm serve` per backend (the plugin and
vLLM's own CPU backend), driven through the `openai` client with streamed one-image chat
completions, so only the harness is checked here, not any speed; both backends must give every
image the same greedy tokens, to the token limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.vision import BACKENDS, CONCURRENCY, QUICK_CASE, cases
from tests.bench.quick import report_text, run_quick

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return run_quick(tmp_path_factory, "vision")


def test_every_case_has_ttft_and_decode_rates(report: tuple[Path, dict]) -> None:
    _, data = report
    assert set(data["cases"]) == {c["name"] for c in cases()}
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
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    ratios = data["summary"]["ratios"]
    assert ratios["ttft_plugin_vs_cpu"] > 0
    assert all(ratios[f"decode_c{n}_plugin_vs_cpu"] > 0 for n in CONCURRENCY)


def test_backends_agree(report: tuple[Path, dict]) -> None:
    _, data = report
    check = data["agreement"]
    assert check["passed"], check
    assert check["identical_across_backends"] and check["first_difference"] is None
    assert check["every_request_full_length"] == {be: True for be in BACKENDS}
    # The images decide the answers: different images, different tokens.
    assert check["distinct_answers"] > 1


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = report_text(
        out, "vision", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Servers")
    )
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
