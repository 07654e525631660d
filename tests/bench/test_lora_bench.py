"""Proves `python -m bench.lora --quick` runs every case and writes lora.json, lora.md and lora.png.

Everything runs for real on the tiny model (the op micro-benchmark on its smallest shapes, two
random adapters, each engine case in its own process), so only the harness is checked here, not
any speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lora import TARGETS, cases
from tests.bench.quick import report_text, run_quick

# Two minutes of engine runs for a harness check: outside CI's time budget.
pytestmark = [pytest.mark.slow, pytest.mark.full]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    pytest.importorskip("peft", reason="the benchmark's adapters are written by PEFT")
    return run_quick(tmp_path_factory, "lora", timeout=300)


def test_every_engine_case_has_positive_figures(report: tuple[Path, dict]) -> None:
    _, data = report
    assert set(data["cases"]) == {c["name"] for c in cases()}
    for name, case in data["cases"].items():
        assert case["median_tpot_ms"] > 0, name
        assert case["output_tok_s"] > 0, name
        assert case["concurrency"] == len(case["adapters"]), name
    split = data["cases"]["lora_split_c8"]["adapters"]
    assert split.count(0) == split.count(1) == 4
    assert len(data["settings"]["adapters"]) == 2
    for path in data["settings"]["adapters"]:
        assert (Path(path) / "adapter_config.json").is_file()


def test_op_cases_and_ratios(report: tuple[Path, dict]) -> None:
    _, data = report
    assert data["ops"], "no op micro-benchmark case"
    for op in data["ops"]:
        for key in ("base_ms", "stacked_update_ms", "gather_update_ms", "stacked_total_ms",
                    "gather_total_ms"):  # fmt: skip
            assert op[key] > 0, (op, key)
    summary = data["summary"]
    assert set(summary["targets"]) == set(TARGETS)
    for key, value in summary["ratios"].items():
        assert value is not None and value > 0, key
    assert summary["targets"]["lora_step_time_vs_base"]["measured"] == pytest.approx(
        data["cases"]["lora_split_c8"]["median_tpot_ms"]
        / data["cases"]["base_c8"]["median_tpot_ms"],
        abs=1e-3,
    )
    # The wrapping with no adapter in the step leaves the base model's projections untouched.
    assert summary["checks"]["wrapping_keeps_base_tokens"]


def test_report_files_are_written(report: tuple[Path, dict]) -> None:
    out, _ = report
    text = report_text(
        out, "lora", ("## Targets", "## Ratios (same run)", "## Engine cases", "## One projection")
    )
    assert "lora_step_time_vs_base" in text and "Measured on" in text
