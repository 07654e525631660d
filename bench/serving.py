"""`vllm serve` under `vllm bench serve`: startup to first token, then TTFT/TPOT/ITL per concurrency.

Runs one server (the plugin, or vLLM's CPU backend with ``--backend cpu``), times its launch until
it answers a completion, then drives it with vLLM's own load generator at each concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# vLLM's log lines that mark the phases of a server start, in launch order.
_MARKERS = {
    "api_server_args_parsed": re.compile(r"non-default args:"),
    "engine_core_started": re.compile(r"Initializing a V1 LLM engine"),
    "model_loaded": re.compile(r"Model loading took"),
    "kv_cache_sized": re.compile(r"KV cache size: "),
    "engine_ready": re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    "api_listening": re.compile(r"Starting vLLM server on"),
}

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env(backend: str) -> dict[str, str]:
    """Environment for a server of ``backend`` ("plugin" or "cpu")."""
    env = dict(os.environ)
    env.pop("VLLM_TARGET_DEVICE", None)
    if backend == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Server:
    """A `vllm serve` subprocess whose output lines are time-stamped as they arrive."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path):
        self.cmd = cmd
        self.log_path = log_path
        self.lines: list[tuple[float, str]] = []
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                t = time.perf_counter() - self.started
                self.lines.append((t, line.rstrip("\n")))
                log.write(f"[{t:8.3f}] {line}")
                log.flush()

    def phases(self) -> dict[str, float]:
        """Seconds from launch to the first log line of each start-up phase seen."""
        lines = list(self.lines)
        found: dict[str, float] = {"first_output": round(lines[0][0], 3)} if lines else {}
        for t, line in lines:
            for name, pattern in _MARKERS.items():
                if name not in found and pattern.search(line):
                    found[name] = round(t, 3)
        return found

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            # The server's process group holds the API server and its engine core.
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def _post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_first_token(server: Server, base_url: str, model: str, timeout: float) -> dict[str, Any]:
    """Poll with a one-token completion until it is served; report the launch-to-token times."""
    deadline = server.started + timeout
    health_at = None
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            if health_at is None:
                with urllib.request.urlopen(base_url + "/health", timeout=2):
                    health_at = time.perf_counter() - server.started
            out = _post_json(
                base_url + "/v1/completions",
                {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
                timeout=max(1.0, deadline - time.perf_counter()),
            )
            first_token = time.perf_counter() - server.started
            if not out.get("choices"):
                raise RuntimeError(f"unexpected completion response: {out}")
            return {
                "launch_to_health_s": round(health_at, 3),
                "launch_to_first_token_s": round(first_token, 3),
                "phases_s": server.phases(),
            }
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.1)
    raise TimeoutError(f"no token served within {timeout:.0f} s:\n{server.tail()}")


def launch(args: argparse.Namespace, log_path: Path) -> tuple[Server, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory-bytes",
        str(args.kv_cache_memory_bytes),
        "--seed",
        "0",
        "--uvicorn-log-level",
        "warning",
    ]
    return Server(cmd, server_env(args.backend), log_path), f"http://127.0.0.1:{port}"


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
    server, base_url = launch(args, out_dir / f"server-{args.backend}.log")
    result: dict[str, Any] = {"backend": args.backend, "command": server.cmd[2:]}
    try:
        result["startup"] = wait_first_token(server, base_url, args.model, args.startup_timeout)
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
