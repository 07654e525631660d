"""Proves `python -m bench.moe --quick` runs every case and writes moe.json, moe.md and moe.png.

Everything runs for real on the tests' tiny Qwen3-MoE, each backend's `vllm.LLM` in its own worker
process, so only the harness is checked here, not any speed; the backends' greedy tokens must
agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.moe import BACKENDS, STREAMS, cases

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    out = tmp_path_factory.mktemp("moe-out")
    work = tmp_path_factory.mktemp("moe-work")
    cmd = [sys.executable, "-m", "bench.moe", "--quick",
           "--out", str(out), "--work-dir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads((out / "moe.json").read_text())


def test_every_case_has_positive_throughput(report: tuple[Path, dict]) -> None:
    _, data = report
    assert set(data["cases"]) == {c["name"] for c in cases()}
    for name, case in data["cases"].items():
        assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, name
        assert case["rounds"] == data["settings"][f"c{case['streams']}_rounds"], name
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
    text = (out / "moe.md").read_text()
    for heading in ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers"):
        assert heading in text
    assert "Measured on" in text and "Quick run" in text
    assert (out / "moe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
