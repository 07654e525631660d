"""Runs one benchmark suite for a test: `python -m bench.run SUITE --quick [--peers]` in a process
of its own, into a folder of its own, on a work folder (checkpoints) shared by the session.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


class SuiteRun:
    """One finished suite run: its output folder and what it wrote."""

    def __init__(self, name: str, out: Path, log: str, seconds: float):
        self.name, self.out, self.log, self.seconds = name, out, log, seconds

    def results(self, stem: str | None = None) -> dict[str, Any]:
        """The suite's `<stem>.json`."""
        path = self.out / f"{stem or self.name}.json"
        assert path.is_file(), f"{self.name} wrote no {path.name}:\n{self.log[-4000:]}"
        return json.loads(path.read_text())

    def report(self, stem: str | None = None, headings: tuple[str, ...] = ()) -> str:
        """`<stem>.md`, once it holds every heading and `<stem>.png` is a PNG."""
        stem = stem or self.name
        text = (self.out / f"{stem}.md").read_text()
        for heading in headings:
            assert heading in text, heading
        assert (self.out / f"{stem}.png").read_bytes()[:8] == PNG
        return text


@pytest.fixture(scope="session")
def bench_work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One work folder for every suite of the session: each checkpoint is written once."""
    return tmp_path_factory.mktemp("bench-work")


@pytest.fixture
def run_suite(tmp_path: Path, bench_work: Path) -> Callable[..., SuiteRun]:
    """`run_suite(name, peers=False, *args)`: the suite's `--quick` run (with `--peers`, and
    `args`), asserted to have exited 0."""
    pytest.importorskip("matplotlib", reason="the reports' plots need matplotlib")

    def run(name: str, peers: bool = False, *args: str) -> SuiteRun:
        out = tmp_path / "out"
        cmd = [sys.executable, "-m", "bench.run", name, "--quick", "--out", str(out),
               "--work-dir", str(bench_work), *(["--peers"] if peers else []), *args]  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=900, check=False)  # fmt: skip
        seconds = time.perf_counter() - started
        print(f"{' '.join(cmd[1:])}: exit {proc.returncode} in {seconds:.0f} s")
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
        return SuiteRun(name, out, proc.stdout, seconds)

    return run
