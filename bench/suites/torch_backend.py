"""The plugin's torch backend against vLLM's CPU backend and the plugin's MLX backend: decode
throughput at 1 and 32 streams, one run, and how far the three engines' greedy tokens agree.

Three engines serve the same checkpoint with the same engine arguments:

- torch: the plugin with `VLLM_METAL_BACKEND=mps` (vLLM's own model classes on torch, attention
  through the plugin's paged kernels; torch's `cpu` device off a Mac);
- vLLM CPU: vLLM's own CPU backend (`VLLM_TARGET_DEVICE=cpu`; the plugin is not loaded);
- MLX: the plugin's default backend (`VLLM_METAL_BACKEND=mlx`, mlx-lm's layers on MLX).

The model is a random-weight Qwen3 from the harness's checkpoint writer
(`bench/harness/checkpoints.py`, `--model-size 0.17b`): 8 layers of Qwen3-0.6B's width (hidden 1024, MLP 3072, 16 query / 8 KV
heads, head_dim 64 as vLLM's CPU backend takes no 16 or 32), an untied 32,000-row vocabulary,
weights from N(0, 0.1): 166 M parameters. Not the main run's 0.6b checkpoint by default: on that
one (tied embedding, N(0, 0.02) weights) greedy decoding repeats one token for several steps at a
time (transformers float32: 2-5 distinct tokens in 16), so the agreement check would say little;
here transformers' 32 greedy tokens are 32 distinct ones. `--model-size 0.6b` measures that one.
The checkpoint is float32: the plugin's MLX backend computes in float32 on MLX's CPU device, and
vLLM's CPU backend and torch run a float32 checkpoint in float32, so all three compute the same
thing.

Each engine is one `vllm.LLM` in a worker process of its own (`bench.harness.workers`),
the engines one after another: one engine's worker is
started, runs all its rounds and is shut down before the next one starts, so no two engines ever
share the cores. The rounds are `bench.harness.decode_rounds`'s: one warm-up round of each size, then
single stream (`--c1-rounds` rounds of 1 request) and 32 concurrent streams (`--c32-rounds` rounds
of 32 requests at once), every request its own prompt of `--input-len` random token ids (the same
prompts, in the same order, for every engine), greedy, EOS ignored, `--output-len` tokens. Decode
tok/s = streams / median TPOT (vLLM's per-request metrics: first to last token over the tokens
between them, so TTFT and prefill are left out). The greedy continuations of the first 32-stream
round are compared between every two engines and across all three ("k/n identical").

    python -m bench.run torch_backend --out docs/benchmarks             # full run, quiet machine
    python -m bench.run torch_backend --quick --out /tmp/torch-quick    # tiny model: the harness

`--quick`: the tests' tiny Qwen3 (`--model-size tiny`: 2 layers, hidden 256, 4 / 2 heads of 64),
16-token prompts, 8 output tokens, one round per case, `enforce_eager` on every engine (vLLM's CPU
backend then skips its torch.compile warm-up). Each engine takes 25-60 s of it on 2 cores, most of
that engine start-up and shutdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.harness.decode_rounds import fill_round_defaults, round_parser
from bench.harness.stages import command_line, runs_peers
from bench.suites.torch_backend_report import write_report

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

STREAMS = (1, 32)
# Run order; each name is a `bench.harness.stages.BACKEND_ENV` entry.
BACKENDS = ("torch", "cpu", "mlx")
DTYPE = "float32"
INPUT_LEN = {False: 128, True: 16}  # by --quick
# The ratios the report leads with: (numerator, denominator) engines.
RATIOS = (("torch", "cpu"), ("mlx", "torch"))


def cases() -> list[dict[str, Any]]:
    return [{"name": f"c{n}_{be}", "streams": n, "backend": be} for n in STREAMS for be in BACKENDS]


def parser() -> argparse.ArgumentParser:
    from bench.harness.checkpoints import SHAPES

    p = round_parser("torch_backend", __doc__,
                     "tiny model, short rounds: checks the harness", streams=STREAMS)  # fmt: skip
    p.add_argument("--model-size", choices=sorted(SHAPES), default=None,
                   help="bench.harness.checkpoints checkpoint: 0.17b (tiny with --quick)")  # fmt: skip
    p.set_defaults(input_len=None)  # INPUT_LEN
    return p


def run_engine(args: argparse.Namespace, desc: dict[str, Any], backend: str,
               logs: Path) -> dict[str, Any]:  # fmt: skip
    """One engine's rounds, alone on the machine; a failure is recorded with its log's tail."""
    from bench.harness.decode_rounds import kv_log
    from bench.harness.decode_rounds import run as run_rounds

    started = time.perf_counter()
    try:
        result = run_rounds(args, desc, logs, backends=(backend,), tag="torch_backend", dtype=DTYPE,
                            keep_tokens=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one engine's failure must not lose the others
        traceback.print_exc()
        log = logs / f"torch_backend_{backend}.log"
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.is_file() else ""
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
                "log": str(log), "log_tail": tail,
                "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    w = result["workers"][backend]
    w["kv"] = kv_log(w["log"])
    w["seconds"] = round(time.perf_counter() - started, 1)
    return {"status": "ok", **result}


def compare(tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Agreement of every two engines' greedy tokens (`decode_rounds.agreement`), and how many
    continuations all of them share."""
    from bench.harness.decode_rounds import agreement

    names = list(tokens)
    pairs = {f"{a}_vs_{b}": agreement(tokens[a], tokens[b])
             for i, a in enumerate(names) for b in names[i + 1:]}  # fmt: skip
    rows = list(zip(*tokens.values()))
    return {
        "engines": names,
        "requests": len(rows),
        "all_identical": sum(all(r == row[0] for r in row) for row in rows),
        "distinct_continuations": {be: len({tuple(t) for t in ts}) for be, ts in tokens.items()},
        "pairs": pairs,
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios of decode tok/s at each stream count (None where an engine failed), each engine's
    many-stream gain over one stream, and whether every engine had room for all streams."""
    cs, big = report["cases"], max(STREAMS)

    def tok_s(n: int, be: str) -> float | None:
        c = cs.get(f"c{n}_{be}")
        return None if c is None else c["decode_tok_s"]

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or y is None else round(x / y, 3)

    return {
        "ratios": {f"c{n}_{a}_vs_{b}": ratio(tok_s(n, a), tok_s(n, b))
                   for n in STREAMS for a, b in RATIOS},
        f"c{big}_vs_c1": {be: ratio(tok_s(big, be), tok_s(1, be)) for be in report["engines_ok"]},
        "concurrency_ok": all((w["kv"]["max_concurrency"] or 0) >= big
                              for w in report["workers"].values()),
        "failed": [be for be, e in report["engines"].items() if e["status"] != "ok"],
    }  # fmt: skip


def cpu_bind() -> str:
    """Every core this process may run on, as `VLLM_CPU_OMP_THREADS_BIND` takes them.

    Left at `auto`, vLLM's CPU worker binds its OpenMP threads to all cores but one (the front
    end's), which is a single core on a 2-core machine, while the torch backend's threads use
    every core: the comparison would measure the binding, not the engines.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with every default filled in."""
    args = parser().parse_args(argv)
    fill_round_defaults(args)
    if args.input_len is None:
        args.input_len = INPUT_LEN[args.quick]
    if args.model_size is None:
        args.model_size = "tiny" if args.quick else "0.17b"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from bench.harness.checkpoints import SHAPES, describe_model, write_model
    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("torch-backend-quick" if args.quick else "torch-backend")
    logs.mkdir(parents=True, exist_ok=True)
    print("[torch_backend] machine", flush=True)
    machine = describe_machine_apart(logs)
    print(f"[torch_backend] checkpoint ({args.model_size}, {DTYPE})", flush=True)
    path = write_model(work / "models", args.model_size, DTYPE, args.seed)
    desc = {"name": path.name, **describe_model(path)}

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind()
    # --quick without --peers: the torch backend alone (vLLM CPU and MLX are there to compare).
    backends = BACKENDS if runs_peers(args) else ("torch",)
    engines = {be: run_engine(args, desc, be, logs) for be in backends}
    ok = [be for be, e in engines.items() if e["status"] == "ok"]
    big = max(STREAMS)
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "model_size": args.model_size,
            "weight_std": SHAPES[args.model_size].weight_std,
            "dtype": DTYPE,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "streams": list(STREAMS),
            "c1_rounds": args.c1_rounds,
            f"c{big}_rounds": getattr(args, f"c{big}_rounds"),
            "seed": args.seed,
            "order": list(backends),
            "vllm_cpu_omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "command": command_line("torch_backend", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "model": desc,
        "engine": next((engines[be]["engine"] for be in ok), None),
        "engines": {
            be: {k: e[k] for k in ("status", "error", "log", "log_tail", "seconds") if k in e}
            for be, e in engines.items()
        },
        "engines_ok": ok,
        "workers": {be: engines[be]["workers"][be] for be in ok},
        "cases": {k: c for be in ok for k, c in engines[be]["cases"].items()},
        "agreement": compare({be: engines[be]["token_ids"][be] for be in ok}),
    }
    assert all(engines[be]["engine"] == report["engine"] for be in ok), "engine arguments differ"
    report["summary"] = summarize(report)
    write_report(report, Path(args.out))
    status = 0
    for be in report["summary"]["failed"]:
        print(f"[torch_backend] {be} failed: {engines[be]['error'][:500]}", file=sys.stderr)
        status = 1
    if not report["summary"]["concurrency_ok"]:
        print(f"[torch_backend] an engine holds fewer than {big} requests", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
