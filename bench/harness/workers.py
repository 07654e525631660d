"""Engine workers: one `vllm.LLM` of one backend in a process of its own, driven over pipes, and
the parent's handle on it (`Worker`).

    python -m bench.harness.workers --engine JSON --inputs FILE --reply-fd FD

Commands arrive as JSON lines on stdin and each gets one JSON reply line on the reply pipe:
`{"op": "generate", "start", "n", "max_tokens"}` (greedy, EOS ignored; TPOT and TTFT from vLLM's
per-request metrics, and each request's prefix-cache hit, `num_cached_tokens`), `{"op": "embed", "start", "n", "save"}` and `{"op": "quit"}`. A suite whose
worker does something else runs its own module with the same arguments (`add_worker_arguments`)
and protocol. Nothing here imports the plugin or MLX at module level: the parent must not run MLX
before it starts engines.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.processes import settle, tree_cpu_seconds
from bench.harness.stages import ROOT, process_env


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The hidden options a suite module is started with when it runs as its own worker."""
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reply-fd", type=int, default=None, help=argparse.SUPPRESS)


def resident_bytes() -> int:
    """Resident memory of this process and its children (the engine core)."""
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in (me, *me.children(recursive=True)))


def reply_pipe(fd: int) -> Any:
    """A function that writes one JSON reply line to the pipe `fd`."""
    reply_file = os.fdopen(fd, "w", buffering=1)

    def reply(obj: dict[str, Any]) -> None:
        reply_file.write(json.dumps(obj) + "\n")
        reply_file.flush()

    return reply


def _generate(llm: Any, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tpot, ttft = [], []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        tpot.append((m.last_token_ts - m.first_token_ts) / max(1, n - 1) * 1e3)
        ttft.append(m.first_token_latency * 1e3)
    return {
        "seconds": seconds,
        "tokens": [len(o.outputs[0].token_ids) for o in outs],
        "tpot_ms": tpot,
        "ttft_ms": ttft,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],  # prefix-cache hits
    }


def _embed(llm: Any, batch: list[str], save: str | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    outs = llm.embed(batch, use_tqdm=False)
    seconds = time.perf_counter() - t0
    if save:
        import numpy as np

        np.save(save, np.array([o.outputs.embedding for o in outs], dtype=np.float32))
    return {
        "seconds": seconds,
        "tokens": [len(o.prompt_token_ids) for o in outs],
        "dim": len(outs[0].outputs.embedding),
    }


def worker(args: argparse.Namespace) -> int:
    """One `vllm.LLM`; commands (JSON lines) on stdin, one JSON reply line each on --reply-fd."""
    reply = reply_pipe(args.reply_fd)
    from vllm import LLM

    inputs = json.loads(Path(args.inputs).read_text())
    started = time.perf_counter()
    llm = LLM(**json.loads(args.engine))
    engine_start_s = time.perf_counter() - started
    from vllm.platforms import current_platform

    reply({
        "ready": True,
        "engine_start_s": round(engine_start_s, 2),
        "platform": type(current_platform).__name__,
        "pooler_config": str(llm.llm_engine.vllm_config.model_config.pooler_config),
        "idle_rss_bytes": resident_bytes(),
    })  # fmt: skip
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        batch = inputs[cmd["start"] : cmd["start"] + cmd["n"]]
        if cmd["op"] == "embed":
            reply(_embed(llm, batch, cmd.get("save")))
        else:
            reply(_generate(llm, batch, cmd["max_tokens"]))
    reply({"bye": True})
    return 0


class Worker:
    """A worker process, its command pipe and its reply pipe."""

    def __init__(self, name: str, backend: str, engine: dict, inputs: Path, log: Path,
                 timeout: float, module: str = "bench.harness.workers"):  # fmt: skip
        """`backend`: a `BACKEND_ENV` name; `module`: the worker's `python -m` module (this one,
        or a suite's own on the same arguments and protocol)."""
        self.name, self.backend, self.log, self.timeout = name, backend, log, timeout
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, "-m", module, "--engine", json.dumps(engine),
               "--inputs", str(inputs), "--reply-fd", str(write_fd)]  # fmt: skip
        with open(log, "w", encoding="utf-8") as f:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=process_env(backend), stdin=subprocess.PIPE, stdout=f,
                stderr=subprocess.STDOUT, text=True, pass_fds=(write_fd,),
                start_new_session=True,
            )  # fmt: skip
        os.close(write_fd)
        self.replies = os.fdopen(read_fd, "r")

    def receive(self) -> dict[str, Any]:
        ready, _, _ = select.select([self.replies], [], [], self.timeout)
        line = self.replies.readline() if ready else ""
        if not line:
            tail = self.log.read_text(encoding="utf-8", errors="replace")[-3000:]
            why = "no reply in time" if not ready else "the worker exited"
            raise RuntimeError(f"{self.name}: {why}; log {self.log}:\n{tail}")
        return json.loads(line)

    def cpu_seconds(self) -> float:
        """CPU time used so far by the worker and every process under it (its engine core)."""
        return tree_cpu_seconds(self.proc.pid)

    def settle(self, window: float = 0.1, busy: float = 0.02, limit: float = 5.0) -> float:
        """Wait until the worker's processes are idle (`bench.harness.processes.settle`)."""
        return settle(self.proc.pid, window, busy, limit)

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def quit(self) -> None:
        """Ask the worker to shut its engine down (no wait)."""
        if self.proc.poll() is None and self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, timeout: float = 120) -> None:
        self.quit()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # its session holds the worker and its engine core
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.replies.close()


def close_all(workers: list[Worker]) -> None:
    """Shut the workers down side by side."""
    for w in workers:
        w.quit()
    for w in workers:
        w.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness.workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--engine", required=True, help="vllm.LLM arguments as JSON")
    p.add_argument("--inputs", required=True, help="a JSON list of the inputs (texts or ids)")
    p.add_argument("--reply-fd", type=int, required=True, help="pipe for the replies")
    return worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
