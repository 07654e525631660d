"""The servers of the speech-to-text benchmark (`bench/speech.py`): one `vllm serve` per backend
with the same arguments, and the rounds of transcription requests sent to it."""

from __future__ import annotations

import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.serving import Server, free_port, server_env

CONCURRENCY = (1, 8)
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
SERVED = "whisper"
MAX_MODEL_LEN = 448  # Whisper's decoder positions
KV_CACHE_BYTES = 256 * 2**20  # 8 requests x (1500 cross + 132 self tokens) x 12 KiB fit twice
LANGUAGE = "en"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def launch(model: Path, backend: str, eager: bool, log: Path) -> tuple[Server, str]:
    """One `vllm serve` of the checkpoint for `backend` (not waited for)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--served-model-name", SERVED,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", DTYPE,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(max(CONCURRENCY)),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--seed", "0",
        "--uvicorn-log-level", "warning",
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    env = server_env(backend)
    env["HF_HUB_OFFLINE"] = "1"
    return Server(cmd, env, log), f"http://127.0.0.1:{port}"


def wait_healthy(server: Server, base_url: str, timeout: float) -> float:
    """Seconds from launch until /health answers."""
    deadline = server.started + timeout
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.tail()}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2):
                return round(time.perf_counter() - server.started, 2)
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"server not healthy within {timeout:.0f} s:\n{server.tail()}")


def counters(base_url: str) -> dict[str, float]:
    """The server's generated-token and preemption counters (summed over their labels)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for name in (GENERATION_TOKENS, PREEMPTIONS):
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
        found = re.finditer(pattern, text, re.MULTILINE)
        out[name] = sum(float(m.group(1)) for m in found)
    return out


class Backend:
    """A started server of one backend, its `openai` client and the rounds sent to it."""

    def __init__(self, name: str, server: Server, base_url: str, timeout: float):
        import openai

        self.name, self.server, self.base_url = name, server, base_url
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused",
                                    max_retries=0, timeout=timeout)  # fmt: skip

    def transcribe(self, wav: bytes, max_tokens: int) -> tuple[float, float, str]:
        """One request: (sent, answered) on the perf counter, and the text."""
        sent = time.perf_counter()
        out = self.client.audio.transcriptions.create(
            model=SERVED,
            file=("clip.wav", wav, "audio/wav"),
            language=LANGUAGE,
            temperature=0.0,
            extra_body={"max_completion_tokens": max_tokens},
        )
        return sent, time.perf_counter(), out.text

    def round(self, n: int, wav: bytes, max_tokens: int) -> dict[str, Any]:
        """`n` requests of the clip released together; wall time, latencies, texts, tokens."""
        barrier = threading.Barrier(n)

        def one(_: int) -> tuple[float, float, str]:
            barrier.wait()
            return self.transcribe(wav, max_tokens)

        before = counters(self.base_url)
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        after = counters(self.base_url)
        first_sent = min(r[0] for r in results)
        return {
            "wall_s": max(r[1] for r in results) - first_sent,
            "latency_s": [r[1] - r[0] for r in results],
            "texts": [r[2] for r in results],
            "generated_tokens": after[GENERATION_TOKENS] - before[GENERATION_TOKENS],
            "preemptions": after[PREEMPTIONS] - before[PREEMPTIONS],
        }
