"""Proves `python -m bench.speech --quick` runs every case and writes speech.json, speech.md and
speech.png.

Everything runs for real on the tests' tiny Whisper: one `vllm serve` per backend (the plugin and
vLLM's own CPU backend), driven through the `openai` client, so only the harness is checked here,
not any speed; both backends must transcribe the clip alike, as transformers does, to the token
limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.speech import BACKENDS, CONCURRENCY, QUICK_CLIP, cases
from tests.bench.quick import report_text, run_quick

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return run_quick(tmp_path_factory, "speech")


def test_every_case_has_a_real_time_factor(report: tuple[Path, dict]) -> None:
    _, data = report
    assert set(data["cases"]) == {c["name"] for c in cases()}
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
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    assert data["servers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["servers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in CONCURRENCY}
    assert set(data["summary"][f"c{max(CONCURRENCY)}_vs_c1"]) == set(BACKENDS)


def test_backends_agree(report: tuple[Path, dict]) -> None:
    _, data = report
    check = data["agreement"]
    assert check["passed"], check
    assert check["identical_across_backends"]
    assert all(check["matches_reference"].values())
    assert check["distinct_texts"] == {be: 1 for be in BACKENDS}
    assert not check["reference"]["stopped_at_eos"]
    assert check["reference"]["num_tokens"] == QUICK_CLIP["max_tokens"]
    assert check["text"].strip()


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = report_text(
        out, "speech", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Servers")
    )
    assert "Measured on" in text and "Quick run" in text and "CPU figures" in text
