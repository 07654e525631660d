"""Proves `python -m bench.torch_backend --quick` runs every case and writes torch-backend.json,
torch-backend.md and torch-backend.png.

Everything runs for real on the tests' tiny Qwen3, the three engines (torch backend, vLLM's CPU
backend, MLX backend) one after another, each `vllm.LLM` in its own worker process, so only the
harness is checked here, not any speed; the engines' first greedy tokens must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.torch_backend import BACKENDS, STREAMS, cases
from tests.bench.quick import assert_round_cases, report_text, run_quick

# About two minutes of engine runs (three engines in turn): outside CI's time budget. CI runs
# the structure check in tests/bench/test_bench_smoke.py.
pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return run_quick(tmp_path_factory, "torch_backend", "torch-backend")


def test_every_case_has_positive_throughput(report: tuple[Path, dict]) -> None:
    _, data = report
    assert_round_cases(data, cases())
    platforms = {be: w["platform"] for be, w in data["workers"].items()}
    assert platforms == {"torch": "MetalPlatform", "cpu": "CpuPlatform", "mlx": "MetalPlatform"}
    assert all(v is not None for v in data["summary"]["ratios"].values())
    assert data["summary"]["failed"] == [] and data["summary"]["concurrency_ok"]
    assert data["engine"]["max_num_seqs"] == max(STREAMS)


def test_engines_agree(report: tuple[Path, dict]) -> None:
    _, data = report
    a = data["agreement"]
    assert a["engines"] == list(BACKENDS) and a["requests"] == max(STREAMS)
    for pair, check in a["pairs"].items():
        assert check["passed"], pair
    assert min(a["distinct_continuations"].values()) > 1


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = report_text(
        out,
        "torch-backend",
        ("## Decode throughput (same run)", "## Agreement", "## Cases", "## Engines"),
    )
    assert "Measured on" in text and "Quick run" in text
