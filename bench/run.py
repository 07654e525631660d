"""Run benchmark suites: one, several, or every one in `--quick` mode.

    python -m bench.run --list                          # the suites, one line each
    python -m bench.run --out docs/benchmarks           # the main run (same as `main --out ...`)
    python -m bench.run SUITE [SUITE ARGS...]           # one suite, e.g. `moe --quick --out DIR`
    python -m bench.run --quick --all --out DIR         # every suite, --quick, each in a process
    python -m bench.run --quick --peers --all --out DIR # the same with every suite's peers
    python -m bench.run report DIR                      # every report in DIR again from its JSON

A suite is a module of `bench.suites` with `main(argv) -> int`; its results go to `--out` as
`<stem>.json`, `<stem>.md` and `<stem>.png` (docs/benchmarks/README.md). With `--all`, a suite
that fails is recorded and the run goes on; the summary at the end names it and the exit status
is non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.stages import ROOT, process_env


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    stems: tuple[str, ...]  # what it writes into --out: <stem>.json (and .md, .png)

    @property
    def module(self) -> str:
        return f"bench.suites.{self.name}"


SUITES = (
    Suite("main", "single stream and `vllm serve`: mlx-lm, the plugin, vLLM CPU, start-up",
          ("results",)),
    Suite("speech", "Whisper speech-to-text through `vllm serve`", ("speech",)),
    Suite("vision", "one-image chat completions through `vllm serve`", ("vision",)),
    Suite("moe", "mixture-of-experts decode, plugin against vLLM CPU", ("moe",)),
    Suite("hybrid", "Qwen3-Next, Qwen3.5, Granite 4.0-H, DeepSeek-V3 and Gemma 4 decode",
          ("hybrid",)),
    Suite("hybrid_prefix", "prefix caching on hybrids: TTFT of a re-sent 4k prompt",
          ("hybrid_prefix",)),
    Suite("gguf", "GGUF and MLX-quantized checkpoints against dense", ("gguf",)),
    Suite("torch_backend", "the torch backend against vLLM CPU and MLX", ("torch-backend",)),
    Suite("pooling", "embedding throughput, plugin against vLLM CPU", ("pooling",)),
    Suite("kv_offload", "KV offload tiers: host and disk against recomputing", ("kv_offload",)),
    Suite("kv_fp8", "fp8 KV cache against unquantized: tokens held, long-context decode",
          ("kv_fp8",)),
    Suite("kv_ptk", "per-token-head KV caches against unquantized: tokens held, decode",
          ("kv_ptk",)),
    Suite("kv_turboquant", "TurboQuant KV caches against unquantized: tokens held, decode",
          ("kv_turboquant",)),
    Suite("lora", "LoRA adapters: the projection update and served engines", ("lora",)),
    Suite("spec_decode", "speculative decoding: n-gram and draft model", ("spec_decode",)),
    Suite("mtp", "MTP speculative decoding on Qwen3.5: its own head, with and without", ("mtp",)),
    Suite("parallel", "data and pipeline parallelism: DP=2 and PP=2 against one process",
          ("parallel",)),
    Suite("profile", "where a decode step's time goes (pyinstrument, in-process engine)",
          ("profile",)),
    Suite("attention", "paged-attention decode kernel against pure-MLX baselines",
          ("attention_decode",)),
    Suite("sliding_window_blocks", "KV blocks a sliding-window model holds",
          ("sliding_window_blocks",)),
    Suite("blas_matmul", "MLX float32 matmul under each CPU BLAS", ("blas_matmul",)),
    Suite("gpu_proxy", "plugin vs mlx-lm on MLX's CUDA backend (docs/gpu-proxy.md)",
          ("gpu_proxy",)),
)  # fmt: skip
BY_NAME = {s.name: s for s in SUITES}


def list_suites() -> str:
    width = max(len(s.name) for s in SUITES)
    return "\n".join(f"{s.name:<{width}}  {s.what}" for s in SUITES)


def run_all_quick(out: Path, work: Path, names: list[str], timeout: float,
                  peers: bool = False) -> int:  # fmt: skip
    """Every suite in `names` with --quick (and --peers), each in a process of its own, one after
    another, all on one work folder (checkpoints written once); `quick-all.json` in `out` records
    each one's status, seconds and log."""
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    record: dict[str, dict] = {}
    started = time.perf_counter()
    for name in names:
        suite = BY_NAME[name]
        cmd = [sys.executable, "-m", suite.module, "--quick", "--out", str(out),
               "--work-dir", str(work), *(["--peers"] if peers else [])]  # fmt: skip
        log = work / "logs" / f"{name}.log"
        print(f"== {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8") as f:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                    env=process_env(), timeout=timeout, check=False).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = None
        missing = [s for s in suite.stems if not (out / f"{s}.json").is_file()]
        ok = rc == 0 and not missing
        record[name] = {
            "status": "ok" if ok else "error",
            "returncode": rc,
            "seconds": round(time.perf_counter() - t0, 1),
            "missing": missing,
            "log": str(log),
        }
        print(f"   {record[name]['status']} in {record[name]['seconds']:.0f} s", file=sys.stderr,
              flush=True)  # fmt: skip
        total = round(time.perf_counter() - started, 1)
        (out / "quick-all.json").write_text(
            json.dumps({"total_seconds": total, "suites": record}, indent=2) + "\n"
        )
    failed = [n for n, r in record.items() if r["status"] != "ok"]
    print(f"{len(names) - len(failed)}/{len(names)} suites ok in {total:.0f} s", file=sys.stderr)
    for name in failed:
        r = record[name]
        why = "timed out" if r["returncode"] is None else f"exit {r['returncode']}"
        extra = f", missing {', '.join(r['missing'])}" if r["missing"] else ""
        print(f"FAILED {name}: {why}{extra}; log {r['log']}", file=sys.stderr)
    return 1 if failed else 0


def regenerate_reports(folder: Path) -> int:
    """Every report in `folder` written again from its JSON (`report DIR`)."""
    done = 0
    for suite in SUITES:
        for stem in suite.stems:
            if (folder / f"{stem}.json").is_file():
                try:
                    module = importlib.import_module(f"{suite.module}_report")
                except ModuleNotFoundError:
                    module = importlib.import_module(suite.module)
                if hasattr(module, "regenerate_report"):
                    module.regenerate_report(folder)
                    print(f"{suite.name}: {stem}.md", file=sys.stderr)
                    done += 1
    return 0 if done else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "report":
        return regenerate_reports(Path(argv[1] if len(argv) > 1 else ROOT / "docs/benchmarks"))
    if argv and argv[0] in BY_NAME:
        return importlib.import_module(BY_NAME[argv[0]].module).main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the suites")
    p.add_argument("--all", action="store_true", help="every suite (with --quick)")
    p.add_argument("--suites", default=None, help="with --all: a comma-separated subset")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per suite with --all")
    known, rest = p.parse_known_args(argv)
    if known.list:
        print(list_suites())
        return 0
    if known.all:
        q = argparse.ArgumentParser(prog="python -m bench.run --all")
        q.add_argument("--quick", action="store_true", required=True)
        q.add_argument("--peers", action="store_true", help="each suite with --peers too")
        q.add_argument("--out", required=True)
        q.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "vllm-metal-quick"))
        args = q.parse_args(rest)
        names = [s.name for s in SUITES] if known.suites is None else known.suites.split(",")
        unknown = set(names) - set(BY_NAME)
        if unknown:
            p.error(f"unknown suites {sorted(unknown)}; --list names them")
        return run_all_quick(Path(args.out), Path(args.work_dir), names, known.timeout, args.peers)
    # No suite named: the main run, as documented (`python -m bench.run --out docs/benchmarks`).
    return importlib.import_module(BY_NAME["main"].module).main(rest)


if __name__ == "__main__":
    sys.exit(main())
