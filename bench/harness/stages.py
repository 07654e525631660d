"""Stages: one piece of a benchmark run in a process of its own, its JSON result recorded as
ok, error or skipped, so that one failing stage does not lose the others.

Also the environment every benchmark process gets (`process_env`, `BACKEND_ENV`) and the
KV-cache size the engines are given (`kv_bytes`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# An engine's environment by backend name: vLLM's own CPU backend (the plugin ignored), the
# plugin's torch backend, or its MLX backend (pinned, so that a VLLM_METAL_BACKEND in the
# caller's shell does not change what "plugin" measures).
BACKEND_ENV = {
    "cpu": {"VLLM_TARGET_DEVICE": "cpu"},
    "torch": {"VLLM_METAL_BACKEND": "mps"},
    "mps": {"VLLM_METAL_BACKEND": "mps"},
    "mlx": {"VLLM_METAL_BACKEND": "mlx"},
    "plugin": {"VLLM_METAL_BACKEND": "mlx"},
}

# The line the plugin logs in every process whose MLX matmuls it set up (vllm_metal/backends/mlx/
# blas.py); each stage records the ones its processes printed.
_BLAS_LINE = re.compile(r"CPU BLAS for MLX: (.*)$")


def process_env(backend: str | None = None) -> dict[str, str]:
    """The environment of a benchmark process: this one's, the repository on PYTHONPATH, no
    VLLM_TARGET_DEVICE unless `backend` is "cpu", and the backend's variables."""
    env = dict(os.environ)
    env.pop("VLLM_TARGET_DEVICE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if backend is not None:
        env.update(BACKEND_ENV.get(backend, {}))
    return env


def suite_parser(name: str, description: str | None, quick_help: str) -> argparse.ArgumentParser:
    """A suite's command line with the options every suite has: `--out` (the results folder),
    `--quick` (`quick_help` says what it runs), `--peers` (with `--quick`, also the engines that
    exist only to compare; see `runs_peers`) and `--work-dir` (checkpoints, logs)."""
    p = argparse.ArgumentParser(prog=f"python -m bench.run {name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="results folder")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--peers", action="store_true",
                   help="run the peers (vLLM CPU, mlx-lm, other engines) under --quick too")  # fmt: skip
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "vllm-metal-bench"),
                   help="checkpoints (reused between runs) and logs")  # fmt: skip
    return p


def add_case_choice(p: argparse.ArgumentParser) -> None:
    """`--cases`: run only the named cases of a suite that runs a list of them (`pick_cases`)."""
    p.add_argument("--cases", nargs="+", default=None, help="only these cases (by name)")


def pick_cases(
    p: argparse.ArgumentParser, args: argparse.Namespace, chosen: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The cases of `chosen` named by `--cases`, in the order named (each case runs in its own
    process, and the first to run pays for caches the later ones find warm, such as MLX's
    compiled kernels); all of them without it. An unknown name is an error."""
    if not args.cases:
        return chosen
    by_name = {c["name"]: c for c in chosen}
    unknown = set(args.cases) - set(by_name)
    if unknown:
        p.error(f"--cases: no case named {', '.join(sorted(unknown))}")
    return [by_name[name] for name in dict.fromkeys(args.cases)]


def runs_peers(args: argparse.Namespace) -> bool:
    """Whether the engines that exist only to compare run: always in a full run; under `--quick`
    only with `--peers` (a quick run checks the suite's own path with one engine)."""
    return bool(getattr(args, "peers", False) or not args.quick)


def command_line(name: str, argv: list[str] | None) -> str:
    """The command that ran suite `name` with `argv` (this process's arguments if None)."""
    return " ".join([f"python -m bench.run {name}", *(argv if argv is not None else sys.argv[1:])])


def blas_log_lines(text: str) -> list[str]:
    """The distinct `CPU BLAS for MLX: ...` reports in a log, in order."""
    found: list[str] = []
    for line in text.splitlines():
        m = _BLAS_LINE.search(line)
        if m and m.group(1).strip() not in found:
            found.append(m.group(1).strip())
    return found


def python_stage(module: str, argv: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """Run ``python -m module argv... --json OUT`` in a fresh process and return its JSON, with
    the CPU BLAS lines its processes logged (`cpu_blas_logged`)."""
    out = log.with_suffix(".json")
    cmd = [sys.executable, "-m", module, *argv, "--json", str(out)]
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout, env=process_env(), check=False)  # fmt: skip
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{module} exited with {proc.returncode}; log {log}:\n{tail}")
    data = json.loads(out.read_text())
    lines = blas_log_lines(log.read_text(encoding="utf-8", errors="replace"))
    if lines and isinstance(data, dict):
        data["cpu_blas_logged"] = lines
    return data


def chosen_families(
    parser: argparse.ArgumentParser, value: str, families: tuple[str, ...]
) -> list[str]:
    """The `--families` subset (comma-separated) of `families`; an unknown name is a usage error."""
    chosen = [f for f in value.split(",") if f]
    unknown = set(chosen) - set(families)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {families}")
    return chosen


def run_families(
    families: list[str], run: Callable[[str], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`run(family)` for each family in turn, each result with the `seconds` it took."""
    results = {}
    for family in families:
        started = time.perf_counter()
        results[family] = run(family)
        results[family]["seconds"] = round(time.perf_counter() - started, 1)
    return results


def keep_earlier_families(
    report: dict[str, Any], earlier_path: Path, order: tuple[str, ...], same: tuple[str, ...]
) -> dict[str, Any]:
    """`report` (this run's `settings`, `machine` and `families`) with the families of the report
    already at `earlier_path` that this run did not measure, so that a run of some `--families`
    updates those rows of a published report instead of dropping the others.

    An earlier family is kept only if it is one of the suite's (`order`, which also orders the
    result) and the two runs' `settings` agree on every key of `same` (what makes their figures
    comparable: dtype, lengths, rounds, `--quick`...); otherwise this run's families alone are
    the report, as without an earlier one, and a line on stderr says why. Each kept family
    carries `earlier_run`: the command, seconds and machine of the run that measured it (kept
    through later merges); this run's families carry none."""
    if not earlier_path.is_file():
        return report
    earlier = json.loads(earlier_path.read_text())
    kept = {f: r for f, r in earlier.get("families", {}).items()
            if f in order and f not in report["families"]}  # fmt: skip
    if not kept:
        return report
    differ = [k for k in same if earlier["settings"].get(k) != report["settings"].get(k)]
    if differ:
        print(f"[stages] not keeping {sorted(kept)} from {earlier_path}: its settings differ in "
              f"{differ}", file=sys.stderr)  # fmt: skip
        return report
    run = {
        "command": earlier["settings"].get("command"),
        "total_seconds": earlier["settings"].get("total_seconds"),
        "machine": earlier.get("machine"),
    }
    for r in kept.values():
        r.setdefault("earlier_run", run)
    print(f"[stages] kept {sorted(kept)} from {earlier_path}", file=sys.stderr, flush=True)
    families = {**report["families"], **kept}
    return {**report, "families": {f: families[f] for f in order if f in families}}


def describe_machine_apart(logs: Path) -> dict[str, Any]:
    """`bench.harness.machine`'s description, taken in a process of its own: a benchmark's
    parent process must not run MLX before it starts engines."""
    return python_stage("bench.harness.machine", [], 600, logs / "machine.log")


def kv_bytes(model: dict[str, Any], max_model_len: int, num_seqs: int) -> int:
    """A KV cache holding ``num_seqs`` full sequences with room to spare (at least 64 MiB);
    `model` is a checkpoint description with `kv_bytes_per_token`."""
    tokens = num_seqs * (math.ceil(max_model_len / 16) + 1) * 16
    return max(64 * 2**20, int(1.5 * tokens * model["kv_bytes_per_token"]))


class StageLog:
    """The sections of one run's results: each stage's entry is its returned figures with
    `status` "ok", or "error" with the exception, or "skipped" with a reason; saved to
    `path` after every stage."""

    def __init__(self, path: Path, sections: tuple[str, ...], selected: list[str]):
        self.path = path
        self.selected = selected
        self.results: dict[str, Any] = {name: {"status": "not run"} for name in sections}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if name not in self.selected:
            self.results[name] = {"status": "skipped", "reason": "not in --stages"}
            self.save()
            return self.results[name]
        print(f"== {name}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            entry = {"status": "ok", **fn()}
        except Exception as exc:  # noqa: BLE001 - one failed stage must not lose the others
            entry = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        entry["stage_seconds"] = round(time.perf_counter() - start, 2)
        self.results[name] = entry
        print(f"   {entry['status']} in {entry['stage_seconds']:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
        self.save()
        return entry

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.results, indent=2) + "\n")

    def failed(self) -> list[str]:
        return [k for k, v in self.results.items()
                if isinstance(v, dict) and v.get("status") == "error"]  # fmt: skip
