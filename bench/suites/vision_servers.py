"""The servers of the vision-language benchmark (`bench/vision.py`): one `vllm serve` per backend
with the same arguments, and the rounds of streamed one-image chat completions sent to it."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import servers
from bench.harness.servers import Server, counters

CONCURRENCY = (1, 8)
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
SERVED = "idefics3"
MAX_MODEL_LEN = 512  # a one-tile image prompt (~90 tokens) and its answer, with room to spare
MAX_NUM_BATCHED_TOKENS = 1024  # the 8 concurrent prompts fit one prefill step
KV_CACHE_BYTES = 256 * 2**20
QUESTION = "Describe this image."
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"


def launch(model: Path, backend: str, eager: bool, log: Path) -> Server:
    """One `vllm serve` of the checkpoint for `backend` (not waited for)."""
    args = [
        "--max-num-seqs", str(max(CONCURRENCY)),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--limit-mm-per-prompt", '{"image": 1}',
        "--uvicorn-log-level", "warning",
        *(["--enforce-eager"] if eager else []),
    ]  # fmt: skip
    return servers.launch(model, log, backend=backend, served_name=SERVED, dtype=DTYPE,
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
                          extra_args=args)  # fmt: skip


def image_data_url(seed: int, size: tuple[int, int]) -> str:
    """`tiny_image(seed, size)` as a PNG data URL."""
    from tests.fixtures.tiny_idefics3 import tiny_image

    buffer = io.BytesIO()
    tiny_image(seed, size).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@dataclass
class Answer:
    """One streamed chat completion: when it was sent, when each chunk carrying generated tokens
    arrived (perf counter), the tokens and text, and the usage the server reported."""

    image_seed: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # generated tokens per such chunk
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def decode_tok_s(self) -> float | None:
        """Generated tokens after the first chunk's / (last token's time - first token's)."""
        window = self.chunk_times[-1] - self.chunk_times[0]
        after_first = len(self.token_ids) - self.chunk_tokens[0]
        return after_first / window if window > 0 and after_first > 0 else None

    def summary(self) -> dict[str, Any]:
        return {
            "image_seed": self.image_seed,
            "ttft_s": self.ttft_s,
            "latency_s": self.chunk_times[-1] - self.sent,
            "decode_s": self.chunk_times[-1] - self.chunk_times[0],
            "decode_tok_s": self.decode_tok_s,
            "generated_tokens": len(self.token_ids),
            "usage_completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "token_chunks": len(self.chunk_times),
        }


class Backend:
    """A started server of one backend, its `openai` client and the rounds sent to it."""

    def __init__(self, name: str, server: Server, timeout: float):
        import openai

        self.name, self.server = name, server
        self.client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused",
                                    max_retries=0, timeout=timeout)  # fmt: skip

    def chat(self, seed: int, image_url: str, max_tokens: int) -> Answer:
        """One streamed one-image chat completion, greedy, exactly `max_tokens` tokens."""
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": QUESTION},
        ]}]  # fmt: skip
        answer = Answer(seed, time.perf_counter())
        stream = self.client.chat.completions.create(
            model=SERVED,
            messages=messages,  # type: ignore[arg-type]
            temperature=0.0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                answer.completion_tokens = chunk.usage.completion_tokens
                answer.prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                ids = getattr(choice, "token_ids", None) or []
                if ids:
                    answer.chunk_times.append(now)
                    answer.chunk_tokens.append(len(ids))
                    answer.token_ids.extend(ids)
                answer.text += choice.delta.content or ""
        if not answer.token_ids:
            raise RuntimeError(f"{self.name}: no tokens streamed for image {seed}")
        return answer

    def round(self, images: list[tuple[int, str]], max_tokens: int) -> dict[str, Any]:
        """One request per (seed, image URL), released together; per-request answers, the round's
        wall time (first sent -> last token) and the server's token and preemption counters."""
        barrier = threading.Barrier(len(images))

        def one(item: tuple[int, str]) -> Answer:
            barrier.wait()
            return self.chat(item[0], item[1], max_tokens)

        before = counters(self.server, (GENERATION_TOKENS, PREEMPTIONS))
        with ThreadPoolExecutor(len(images)) as pool:
            answers = list(pool.map(one, images))
        after = counters(self.server, (GENERATION_TOKENS, PREEMPTIONS))
        return {
            "answers": answers,
            "wall_s": max(a.chunk_times[-1] for a in answers) - min(a.sent for a in answers),
            "generated_tokens": after[GENERATION_TOKENS] - before[GENERATION_TOKENS],
            "preemptions": after[PREEMPTIONS] - before[PREEMPTIONS],
        }
