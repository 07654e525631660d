"""The servers of the speech-to-text benchmark (`bench/speech.py`): one `vllm serve` per backend
with the same arguments, and the rounds of transcription requests sent to it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import servers
from bench.harness.servers import Server, counters

CONCURRENCY = (1, 8)
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
SERVED = "whisper"
MAX_MODEL_LEN = 448  # Whisper's decoder positions
KV_CACHE_BYTES = 256 * 2**20  # 8 requests x (1500 cross + 132 self tokens) x 12 KiB fit twice
LANGUAGE = "en"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def launch(model: Path, backend: str, eager: bool, log: Path) -> Server:
    """One `vllm serve` of the checkpoint for `backend` (not waited for)."""
    args = [
        "--max-num-seqs", str(max(CONCURRENCY)),
        "--uvicorn-log-level", "warning",
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    return servers.launch(model, log, backend=backend, served_name=SERVED, dtype=DTYPE,
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
                          extra_args=args)  # fmt: skip


class Backend:
    """A started server of one backend, its `openai` client and the rounds sent to it."""

    def __init__(self, name: str, server: Server, timeout: float):
        import openai

        self.name, self.server = name, server
        self.client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused",
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

        before = counters(self.server, (GENERATION_TOKENS, PREEMPTIONS))
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        after = counters(self.server, (GENERATION_TOKENS, PREEMPTIONS))
        first_sent = min(r[0] for r in results)
        return {
            "wall_s": max(r[1] for r in results) - first_sent,
            "latency_s": [r[1] - r[0] for r in results],
            "texts": [r[2] for r in results],
            "generated_tokens": after[GENERATION_TOKENS] - before[GENERATION_TOKENS],
            "preemptions": after[PREEMPTIONS] - before[PREEMPTIONS],
        }
