"""`vllm serve` subprocesses: the one launcher, `Server` handle and stop that the benchmark
suites and the serving tests (tests/serving/conftest.py) share.

A server runs in its own process group (API server and engine core), its output lines are
time-stamped as they arrive and written to its log; `Server` reaches its HTTP API (`post`, `get`,
the Prometheus `metrics`) and tells the start-up phases from vLLM's log lines.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests

from bench.harness.processes import settle, tree_cpu_seconds
from bench.harness.stages import blas_log_lines, process_env

# vLLM's log lines that mark the phases of a server start, in launch order.
_MARKERS = {
    "api_server_args_parsed": re.compile(r"non-default args:"),
    "engine_core_started": re.compile(r"Initializing a V1 LLM engine"),
    "model_loaded": re.compile(r"Model loading took"),
    "kv_cache_sized": re.compile(r"KV cache size: "),
    "engine_ready": re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    "api_listening": re.compile(r"Starting vLLM server on"),
}
# One Prometheus sample line, and the labels inside its braces.
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# Listening ports are drawn from here, below the kernel's ephemeral range: a port from that
# range (what bind(0) gives) can be taken by another process's outgoing connection in the
# seconds before `vllm serve` binds it.
_LISTEN_PORTS_FROM = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL_LOW_ELSEWHERE = 49152  # the IANA dynamic range, macOS's default first port


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_ELSEWHERE


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, chosen at random below the
    ephemeral range (so no outgoing connection is given it before the server binds it)."""
    high = _ephemeral_low()
    if high <= _LISTEN_PORTS_FROM:
        raise RuntimeError(f"the ephemeral port range starts at {high}: no port below it to use")
    rng = random.Random()  # its own state: a seeded global `random` must not repeat ports
    for _ in range(100):
        port = rng.randrange(_LISTEN_PORTS_FROM, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port found in {_LISTEN_PORTS_FROM}..{high - 1}")


def log_tail(path: Path, lines: int = 60) -> str:
    """The last `lines` lines of a log file."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus exposition text as (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m["labels"] or ""))
            samples.append((m["name"], labels, float(m["value"])))
    return samples


class Server:
    """A running `vllm serve`: where it listens, its key, its served model name, its log."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path, *, port: int,
                 model: str, model_dir: Path, api_key: str | None = None,
                 max_model_len: int | None = None):  # fmt: skip
        self.cmd = cmd
        self.base_url = f"http://127.0.0.1:{port}"  # no /v1
        self.api_key = api_key
        self.model = model
        self.model_dir = model_dir
        self.log_path = log_path
        self.max_model_len = max_model_len
        self.lines: list[tuple[float, str]] = []  # (seconds since launch, line)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1, start_new_session=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with open(self.log_path, "w", encoding="utf-8") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            for line in self.process.stdout:
                t = time.perf_counter() - self.started
                self.lines.append((t, line.rstrip("\n")))
                log.write(f"[{t:8.3f}] {line}")
                log.flush()

    # ------------------------------------------------------------------ HTTP

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url + path

    def post(self, path: str, body: Any, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 120)
        return requests.post(self.url(path), json=body, headers=self.headers, **kwargs)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 30)
        return requests.get(self.url(path), headers=self.headers, **kwargs)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Prometheus samples of /metrics as (name, labels, value)."""
        return parse_metrics(self.get("/metrics").text)

    def gauge(self, name: str, **labels: str) -> float:
        """Sum of the samples of metric `name` whose labels include `labels`, at this moment."""
        return sum(
            value
            for sample_name, sample_labels, value in self.metrics()
            if sample_name == name and labels.items() <= sample_labels.items()
        )

    # ------------------------------------------------------------- lifecycle

    def alive(self) -> bool:
        return self.process.poll() is None

    def tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def context(self) -> str:
        """Text to append to error and assertion messages: the end of the server's log."""
        state = "running" if self.alive() else f"exited with {self.process.returncode}"
        return f"\n--- server {state}; last lines of {self.log_path} ---\n{self.tail()}"

    def phases(self) -> dict[str, float]:
        """Seconds from launch to the first log line of each start-up phase seen."""
        lines = list(self.lines)
        found: dict[str, float] = {"first_output": round(lines[0][0], 3)} if lines else {}
        for t, line in lines:
            for name, pattern in _MARKERS.items():
                if name not in found and pattern.search(line):
                    found[name] = round(t, 3)
        return found

    def wait_healthy(self, timeout: float) -> float:
        """Seconds from launch until /health answers 200; stops the server if it never does."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            if not self.alive():
                raise RuntimeError(f"vllm serve exited during startup{self.context()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url("/health"), timeout=2).status_code == 200:
                    return round(time.perf_counter() - self.started, 3)
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s{self.context()}")

    def wait_first_token(self, timeout: float) -> dict[str, Any]:
        """Wait for /health, then poll with a one-token completion until it is served; the
        launch-to-health and launch-to-first-token seconds and the start-up phases."""
        health_at = self.wait_healthy(timeout)
        deadline = self.started + timeout
        body = {"model": self.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        while time.perf_counter() < deadline:
            if not self.alive():
                raise RuntimeError(f"vllm serve exited{self.context()}")
            with contextlib.suppress(requests.RequestException):
                response = self.post("/v1/completions", body,
                                     timeout=max(1.0, deadline - time.perf_counter()))  # fmt: skip
                if response.status_code == 200:
                    first_token = time.perf_counter() - self.started
                    if not response.json().get("choices"):
                        raise RuntimeError(f"unexpected completion response: {response.text}")
                    return {
                        "launch_to_health_s": health_at,
                        "launch_to_first_token_s": round(first_token, 3),
                        "phases_s": self.phases(),
                    }
            time.sleep(0.1)
        raise TimeoutError(f"no token served within {timeout:.0f} s{self.context()}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what remains (the engine core may
        outlive the API server for a moment)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self._reader.join(timeout=5)


def launch(
    model_dir: Path | str,
    log_path: Path,
    *,
    backend: str = "plugin",
    served_name: str | None = None,
    api_key: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 1024,
    kv_cache_bytes: int = 64 * 2**20,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """Start `vllm serve` of `model_dir` on a free port for `backend` (a `BACKEND_ENV` name;
    `env` is laid over it), not waited for. Later `extra_args` win over the ones here."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
        *(["--served-model-name", served_name] if served_name else []),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--seed", "0",
        *(["--api-key", api_key] if api_key and "--api-key" not in extra_args else []),
        *extra_args,
    ]  # fmt: skip
    full_env = {**process_env(backend), **(env or {})}
    if backend != "cpu":
        full_env.pop("VLLM_TARGET_DEVICE", None)  # that would select vLLM's own CPU platform
    full_env.update(HF_HUB_OFFLINE="1", PYTHONFAULTHANDLER="1")
    return Server(cmd, full_env, log_path, port=port, model=served_name or str(model_dir),
                  model_dir=Path(model_dir), api_key=api_key,
                  max_model_len=max_model_len)  # fmt: skip


def start_server(
    model_dir: Path,
    log_path: Path,
    *,
    served_name: str,
    api_key: str | None,
    extra_args: Sequence[str] = (),
    max_model_len: int = 1024,
    env: dict[str, str] | None = None,
    kv_cache_bytes: int = 64 * 2**20,
    timeout: float = 300.0,
) -> Server:
    """Launch `vllm serve` with the plugin (MLX unless `env` names another backend) and wait
    for /health."""
    server = launch(model_dir, log_path, backend="mlx", served_name=served_name,
                    api_key=api_key, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                    extra_args=extra_args, env=env)  # fmt: skip
    server.wait_healthy(timeout)
    return server


def stop_server(server: Server, timeout: float = 30.0) -> None:
    """Stop a server and everything in its process group."""
    server.stop(timeout)


def counters(server: Server, names: Sequence[str]) -> dict[str, float]:
    """The server's counters `names` at this moment, each summed over its labels."""
    samples = server.metrics()
    return {name: sum(v for n, _, v in samples if n == name) for name in names}


def server_info(server: Server, ready: dict[str, Any]) -> dict[str, Any]:
    """What a stopped benchmark server's log says about it (`ready`: its start-up figures
    beside): the platform that served, the start-up phases, the CPU BLAS lines, and the cores
    vLLM's CPU worker bound its OpenMP threads to."""
    text = server.log_path.read_text(encoding="utf-8", errors="replace")
    bound = re.search(r"core ids=\[([^\]]*)\]", text)
    platform = ("MetalPlatform" if "vllm-metal: backend" in text
                else "CpuPlatform" if "cpu_model_runner" in text else None)  # fmt: skip
    return {**ready, "platform": platform, "phases_s": server.phases(),
            "command": server.cmd[2:], "log": str(server.log_path),
            "cpu_blas_logged": blas_log_lines(text),
            "omp_bound_cores": bound.group(1) if bound else None}  # fmt: skip


def wait_group_gone(pgid: int, limit: float = 60.0) -> None:
    """Wait until every process of a stopped server's process group (its engine core too) has
    exited."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def wait_all_healthy(servers: dict[str, Server], timeout: float) -> tuple[dict[str, dict], float]:
    """Wait for every server started side by side: each one's launch-to-health seconds, and the
    seconds from the first launch until all answer."""
    ready = {name: {"launch_to_health_s": s.wait_healthy(timeout)} for name, s in servers.items()}
    first = min(s.started for s in servers.values())
    return ready, time.perf_counter() - first


def round_robin(servers: dict[str, Server], k: int,
                send: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Round `k` on every server in turn (`send(name)` makes the round's requests), the order
    reversed on odd rounds, each started once the previous server is idle again. Beside what
    `send` returns: the CPU seconds the server's processes used in its round (`cpu_s`), those the
    other servers used meanwhile (`other_cpu_s`, which should be none), the load average and
    how long the server took to settle after it (`busy_after_s`)."""
    names = list(servers)
    out = {}
    for name in names if k % 2 == 0 else names[::-1]:
        own = servers[name].process.pid
        others = [s.process.pid for n, s in servers.items() if n != name]
        own_before = tree_cpu_seconds(own)
        others_before = sum(tree_cpu_seconds(pid) for pid in others)
        result = send(name)
        result["cpu_s"] = tree_cpu_seconds(own) - own_before
        result["other_cpu_s"] = sum(tree_cpu_seconds(pid) for pid in others) - others_before
        result["load_1m"] = os.getloadavg()[0]
        result["busy_after_s"] = settle(own)
        out[name] = result
    return out


def stop_all(servers: dict[str, Server]) -> None:
    """Stop every server, then wait until each one's process group is gone."""
    for server in servers.values():
        server.stop()
    for server in servers.values():
        wait_group_gone(server.process.pid)
