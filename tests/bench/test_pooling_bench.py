"""Proves `python -m bench.pooling --quick` runs every case and writes pooling.json, pooling.md and
pooling.png.

Everything runs for real on the tiny models (the tiny decoder of `bench/model.py`, the tiny
`bert-embed` encoder), each backend's `vllm.LLM` in its own worker process, so only the harness is
checked here, not any speed; the agreement check must pass (both backends embed alike).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pooling import BACKENDS, BATCHES, MODELS, cases

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    out = tmp_path_factory.mktemp("pooling-out")
    work = tmp_path_factory.mktemp("pooling-work")
    cmd = [sys.executable, "-m", "bench.pooling", "--quick",
           "--out", str(out), "--work-dir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads((out / "pooling.json").read_text())


def test_every_case_has_positive_throughput(report: tuple[Path, dict]) -> None:
    _, data = report
    assert set(data["cases"]) == {c["name"] for c in cases()}
    assert len(data["cases"]) == len(MODELS) * len(BATCHES) * len(BACKENDS)
    for name, case in data["cases"].items():
        assert case["inputs_per_s"] > 0, name
        assert case["median_call_s"] > 0, name
        assert case["calls"] == data["settings"][f"b{min(case['batch'], 32)}_calls"], name
        assert case["tokens_per_input"]["min"] >= data["settings"]["input_tokens"], name
    # Each backend ran where it should: the plugin's platform, and vLLM's own CPU platform.
    for kind, model in data["models"].items():
        assert model["workers"]["plugin"]["platform"] == "MetalPlatform", kind
        assert model["workers"]["cpu"]["platform"] == "CpuPlatform", kind
    ratios = data["summary"]["ratios"]
    assert set(ratios) == {f"{m}_b{b}_plugin_vs_cpu" for m in MODELS for b in BATCHES}
    assert all(r > 0 for r in ratios.values())


def test_backends_agree(report: tuple[Path, dict]) -> None:
    _, data = report
    for kind, model in data["models"].items():
        check = model["agreement"]
        assert check["passed"], (kind, check)
        assert check["min_cosine"] >= 0.999, kind
        assert check["same_token_counts"], kind
        assert check["inputs"] == max(BATCHES), kind
    assert all(data["summary"]["agreement_passed"].values())


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = (out / "pooling.md").read_text()
    for heading in ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers"):
        assert heading in text
    assert "Measured on" in text and "Quick run" in text
    assert (out / "pooling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
