"""Proves `python -m bench.pooling --quick` runs every case and writes pooling.json, pooling.md and
pooling.png.

Everything runs for real on the tiny models (the tiny decoder of `bench/model.py`, the tiny
`bert-embed` encoder), each backend's `vllm.LLM` in its own worker process, so only the harness is
checked here, not any speed; the agreement check must pass (both backends embed alike).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pooling import BACKENDS, BATCHES, MODELS, cases
from tests.bench.quick import report_text, run_quick

pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    return run_quick(tmp_path_factory, "pooling")


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
    text = report_text(
        out,
        "pooling",
        ("## Plugin / vLLM CPU (same run)", "## Agreement", "## Cases", "## Workers"),
    )
    assert "Measured on" in text and "Quick run" in text
