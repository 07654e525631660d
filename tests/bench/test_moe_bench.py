"""Proves `python -m bench.moe --quick` runs every case and writes moe.json, moe.md and moe.png.

Everything runs for real on the tests' tiny Qwen3-MoE, each backend's `vllm.LLM` in its own worker
process, so only the harness is checked here, not any speed; the backends' greedy tokens must
agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.moe import BACKENDS, STREAMS, cases
from tests.bench.quick import assert_round_cases, report_text, run_quick

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return run_quick(tmp_path_factory, "moe")


def test_every_case_has_positive_throughput(report: tuple[Path, dict]) -> None:
    _, data = report
    assert_round_cases(data, cases())
    assert data["workers"]["plugin"]["platform"] == "MetalPlatform"
    assert data["workers"]["cpu"]["platform"] == "CpuPlatform"
    assert set(data["summary"]["ratios"]) == {f"c{n}_plugin_vs_cpu" for n in STREAMS}
    assert set(data["summary"][f"c{max(STREAMS)}_vs_c1"]) == set(BACKENDS)
    model = data["model"]
    assert model["architecture"] == "Qwen3MoeForCausalLM"
    assert model["active_parameters_per_token"] < model["num_parameters"]


def test_backends_agree(report: tuple[Path, dict]) -> None:
    _, data = report
    check = data["agreement"]
    assert check["passed"] and check["requests"] == max(STREAMS)
    assert check["distinct_continuations"] > 1


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = report_text(
        out, "moe", ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers")
    )
    assert "Measured on" in text and "Quick run" in text
