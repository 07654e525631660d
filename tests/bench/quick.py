"""What the `--quick` tests of the benchmark modules share: one run of a module in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_quick(
    tmp_path_factory: pytest.TempPathFactory, name: str, stem: str | None = None,
    timeout: float = 600,
) -> tuple[Path, dict]:  # fmt: skip
    """Run `python -m bench.<name> --quick` into fresh folders; return the output folder and its
    `<stem>.json` (`stem` defaults to `name`). Skipped without matplotlib (the reports' plots)."""
    pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib")
    out = tmp_path_factory.mktemp(f"{name}-out")
    work = tmp_path_factory.mktemp(f"{name}-work")
    cmd = [sys.executable, "-m", f"bench.{name}", "--quick",
           "--out", str(out), "--work-dir", str(work)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out, json.loads((out / f"{stem or name}.json").read_text())


def report_text(out: Path, stem: str, headings: tuple[str, ...]) -> str:
    """The report `<stem>.md` in `out`, once it is seen to hold every heading and its plot
    `<stem>.png` to be a PNG."""
    text = (out / f"{stem}.md").read_text()
    for heading in headings:
        assert heading in text, heading
    assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return text


def assert_round_cases(data: dict, cases: list[dict]) -> None:
    """A decode-round benchmark's results (`bench.decode_rounds.run`) hold every case of
    `cases`, each with positive rates over the rounds its settings asked for."""
    assert set(data["cases"]) == {c["name"] for c in cases}
    for name, case in data["cases"].items():
        assert case["decode_tok_s"] > 0 and case["output_tok_s"] > 0, name
        assert case["rounds"] == data["settings"][f"c{case['streams']}_rounds"], name
