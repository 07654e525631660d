"""`vllm serve` under `vllm bench serve`: startup to first token, then TTFT/TPOT/ITL per concurrency
(the main suite's serve stages: `python -m bench.harness.serve_load ... --json OUT`).

Runs one server (the plugin, or vLLM's CPU backend with ``--backend cpu``), times its launch until
it answers a completion, then drives it with vLLM's own load generator at each concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import servers
from bench.harness.servers import Server

_SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_concurrent_requests",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


def launch(args: argparse.Namespace, log_path: Path) -> Server:
    """The server `args` describe (model, backend, lengths, sequences, KV cache), not waited for."""
    return servers.launch(
        args.model, log_path, backend=args.backend, dtype=args.dtype,
        max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_memory_bytes,
        extra_args=["--max-num-seqs", str(args.max_num_seqs), "--uvicorn-log-level", "warning"],
    )  # fmt: skip


def bench_serve_args(
    base_url: str, args: argparse.Namespace, concurrency: int, num_prompts: int, out_dir: Path
) -> list[str]:
    """`vllm bench serve` arguments for one run (random dataset, fixed lengths, greedy, EOS
    ignored)."""
    return [
        "--backend", "vllm",
        "--base-url", base_url,
        "--model", args.model,
        "--tokenizer", args.model,
        "--dataset-name", "random",
        "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0.0",
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency),
        "--request-rate", "inf",
        "--ignore-eos",
        "--temperature", "0",
        "--seed", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(out_dir),
        "--result-filename", f"{args.backend}-c{concurrency}.json",
    ]  # fmt: skip


def bench_serve(
    base_url: str, args: argparse.Namespace, concurrency: int, num_prompts: int, out_dir: Path
) -> dict[str, Any]:
    """One run of vLLM's serving benchmark, the code behind `vllm bench serve`.

    It runs in this process (parsed by the same argument parser as the CLI) rather than as a new
    `vllm bench serve` process per concurrency, which would spend ~10 s importing vLLM each time
    on the cores the server needs.
    """
    import contextlib

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = bench_serve_args(base_url, args, concurrency, num_prompts, out_dir)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(cli)
    log_path = out_dir / f"{args.backend}-c{concurrency}.log"
    with open(log_path, "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        raw = serve_main(ns)
    summary = {k: raw.get(k) for k in _SUMMARY_KEYS if k in raw}
    if not summary.get("completed"):
        raise RuntimeError(f"no request completed; see {log_path}")
    summary["concurrency"] = concurrency
    summary["num_prompts"] = num_prompts
    summary["command"] = "vllm bench serve " + " ".join(cli)
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.work_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    server = launch(args, out_dir / f"server-{args.backend}.log")
    base_url = server.base_url
    result: dict[str, Any] = {"backend": args.backend, "command": server.cmd[2:]}
    try:
        result["startup"] = server.wait_first_token(args.startup_timeout)
        runs = []
        if not args.startup_only:
            for c in args.concurrency:
                num_prompts = max(c * args.waves, args.min_prompts)
                started = time.perf_counter()
                summary = bench_serve(base_url, args, c, num_prompts, out_dir)
                summary["wall_s"] = round(time.perf_counter() - started, 2)
                runs.append(summary)
                print(
                    f"[{args.backend}] c={c}: {summary.get('output_throughput', 0):.2f} tok/s, "
                    f"TPOT {summary.get('mean_tpot_ms', 0):.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        result["runs"] = runs
    finally:
        server.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--backend", choices=("plugin", "cpu"), default="plugin")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--waves", type=int, default=1, help="requests per run = waves x concurrency")
    p.add_argument("--min-prompts", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 2**20)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--run-timeout", type=float, default=1200.0)
    p.add_argument("--startup-only", action="store_true")
    p.add_argument("--work-dir", required=True)
    p.add_argument("--json", required=True, help="where to write the result")
    args = p.parse_args(argv)
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
