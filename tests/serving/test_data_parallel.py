"""`vllm serve --data-parallel-size 2`: two MLX engine replicas behind vLLM's API servers and DP
coordinator answer concurrent clients with the greedy tokens one process gives (transformers
float32, which tests/backends/test_parity.py holds one process to) through chunked prefill,
preemption and a prefix-cache round; killing one replica's engine process ends every client's
request and the server, with the dead replica named, instead of hanging.

Cost: one two-replica server, about a minute of one CI worker.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.backends.mlx.runner.jobs import kv_block_bytes, random_prompts
from tests.fixtures.oracles import hf_greedy
from tests.serving.conftest import Server, ServerSlot

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

MAX_MODEL_LEN = 128  # 8 blocks of 16: one request fits a replica's pool
POOL_BLOCKS = 12  # per replica: two 112-token sequences (14 blocks) do not fit
NEW_TOKENS = 24
MIXED = random_prompts(1, [1, 5, 17, 40, 75])
SHARED_PREFIX = random_prompts(2, [48])[0]
PREFIX_HITS = [SHARED_PREFIX + tail for tail in random_prompts(3, [3, 9])]
# Six 112-token sequences sent at once over two replicas: any two that run together on one
# (a replica gets three) outgrow its pool, and it preempts.
PREEMPTED = random_prompts(7, [48] * 6)
PREEMPTED_TOKENS = 64


@pytest.fixture
def dp_server(server_slot: ServerSlot, tiny_model_dir) -> Server:
    model = tiny_model_dir("qwen3")
    args = [
        "--data-parallel-size", "2",
        "--max-num-batched-tokens", "16",  # prompts longer than 16 tokens prefill in chunks
        "--max-num-seqs", "8",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(POOL_BLOCKS * kv_block_bytes(model)),  # per replica
    ]  # fmt: skip
    return server_slot.get(
        ("data-parallel", str(model)), model, served_name="tiny", api_key=None, extra_args=args
    )


def _complete(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = server.post("/v1/completions", body, timeout=300)
    assert response.status_code == 200, response.text + server.context()
    return response.json()["choices"][0]["token_ids"]


def _concurrently(server: Server, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(server, p, max_tokens), prompts))


def _per_engine(server: Server, name: str) -> dict[str, float]:
    totals: dict[str, float] = {}
    for sample, labels, value in server.metrics():
        if sample == name:
            engine = labels.get("engine", "?")
            totals[engine] = totals.get(engine, 0.0) + value
    return totals


def test_two_replicas_give_one_process_greedy_tokens_to_concurrent_clients(
    dp_server, tiny_model_dir
):
    server = dp_server
    model = tiny_model_dir("qwen3")
    assert _concurrently(server, MIXED, NEW_TOKENS) == hf_greedy(model, MIXED, NEW_TOKENS)

    _complete(server, SHARED_PREFIX + [5], 4)
    hits = [_complete(server, p, NEW_TOKENS) for p in PREFIX_HITS]
    assert hits == hf_greedy(model, PREFIX_HITS, NEW_TOKENS)
    assert sum(_per_engine(server, "vllm:prefix_cache_hits_total").values()) >= 32

    preempted = _concurrently(server, PREEMPTED, PREEMPTED_TOKENS)
    assert preempted == hf_greedy(model, PREEMPTED, PREEMPTED_TOKENS)
    assert sum(_per_engine(server, "vllm:num_preemptions_total").values()) > 0

    served = _per_engine(server, "vllm:request_success_total")
    assert sorted(served) == ["0", "1"] and all(n > 0 for n in served.values()), served


def _process_titled(server, title: str) -> int:
    """The pid of the server's process vLLM titled `title` (its process title, which holds
    whatever logging configuration the server runs with)."""
    import psutil

    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if title in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no process titled {title} under the server")


def test_killing_one_replica_ends_every_request_and_the_server(dp_server, server_slot):
    server = dp_server
    engine_pid = _process_titled(server, "EngineCore_DP1")
    prompts = random_prompts(11, [8] * 8)

    def stream(prompt: list[int]) -> str:
        body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 8,
                "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            with server.post("/v1/completions", body, stream=True, timeout=120) as response:
                if response.status_code != 200:
                    return f"status {response.status_code}"
                text = b"".join(response.iter_content(None)).decode(errors="replace")
        except requests.RequestException as exc:
            return f"dropped: {type(exc).__name__}"
        return "error event" if '"error"' in text else "complete" if "[DONE]" in text else "cut"

    started = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [pool.submit(stream, p) for p in prompts]
        time.sleep(1.0)
        os.kill(engine_pid, signal.SIGKILL)
        outcomes = [r.result(timeout=180) for r in results]
    assert time.perf_counter() - started < 180
    deadline = time.perf_counter() + 60
    while server.alive() and time.perf_counter() < deadline:
        time.sleep(0.5)
    assert not server.alive(), "the server kept running without one of its replicas"
    assert "EngineCore_DP1 died unexpectedly" in server.tail(200), server.context()
    assert any(o != "complete" for o in outcomes), outcomes  # some were cut by the kill
    server_slot.close()


@pytest.mark.full
def test_moe_replicas_step_together_and_give_one_process_greedy_tokens(
    server_slot, tmp_path_factory
):
    # A mixture-of-experts model runs vLLM's DP engine: the replicas keep in step over a gloo
    # group and an idle one runs dummy steps (`MetalWorker.execute_dummy_batch`).
    from tests.fixtures.tiny_moe import write_tiny_moe

    model = write_tiny_moe(tmp_path_factory.mktemp("dp-moe") / "qwen3_moe", "qwen3_moe")
    args = ["--data-parallel-size", "2", "--max-num-batched-tokens", "16",
            "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    server = server_slot.get(
        ("data-parallel-moe", str(model)), model, served_name="tiny", api_key=None, extra_args=args
    )
    assert _concurrently(server, MIXED, NEW_TOKENS) == hf_greedy(model, MIXED, NEW_TOKENS)
    assert "rank 1 in world size 2 is assigned as DP rank 1" in server.tail(10_000)
    served = _per_engine(server, "vllm:request_success_total")
    assert sorted(served) == ["0", "1"] and all(n > 0 for n in served.values()), served
    server_slot.close()
