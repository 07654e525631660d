"""Proves the plugin's server completes 64 concurrent streams exactly and frees the KV cache of
clients that disconnect mid-stream (read back from /metrics).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

NUM_STREAMS = 64
NUM_DISCONNECTS = 16


def wait_until(predicate, timeout: float, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def engine_idle(server: Any) -> bool:
    return (
        server.gauge("vllm:num_requests_running") == 0
        and server.gauge("vllm:num_requests_waiting") == 0
        and server.gauge("vllm:kv_cache_usage_perc") == 0
    )


def test_64_concurrent_streams_complete_with_the_requested_token_counts(vllm_server):
    import openai

    client = openai.AsyncOpenAI(
        base_url=vllm_server.url("/v1"), api_key=vllm_server.api_key, timeout=300, max_retries=0
    )
    # Different lengths and prompts, so requests finish at different steps and the batch
    # keeps changing shape.
    wanted = [8 + (i % 5) * 6 for i in range(NUM_STREAMS)]

    async def one(i: int) -> tuple[int, int, int, str | None]:
        stream = await client.completions.create(
            model=vllm_server.model,
            prompt=f"Request {i}: the weather in Paris is" + " sunny" * (i % 7),
            max_tokens=wanted[i],
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids, usage, finish = 0, -1, None
        async for chunk in stream:
            for choice in chunk.choices:
                ids += len(choice.token_ids or [])
                finish = choice.finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return i, ids, usage, finish

    async def run() -> list[tuple[int, int, int, str | None]]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))

    results = asyncio.run(run())
    wrong = [
        (i, ids, usage, finish)
        for i, ids, usage, finish in results
        if not (ids == usage == wanted[i] and finish == "length")
    ]
    assert not wrong, (
        f"(index, streamed ids, usage, finish) off target: {wrong}{vllm_server.context()}"
    )
    assert wait_until(lambda: engine_idle(vllm_server), timeout=30), vllm_server.context()


def test_disconnected_clients_are_aborted_and_their_kv_blocks_freed(vllm_server):
    assert wait_until(lambda: engine_idle(vllm_server), timeout=30), "not idle before the test"
    finished_before = vllm_server.gauge("vllm:request_success_total", finished_reason="length")
    # Long generations that would run for minutes if nobody stopped them.
    body = {
        "model": vllm_server.model,
        "prompt": "Once upon a time " * 20,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    busy: dict[str, float] = {}

    async def one(client: httpx.AsyncClient, i: int) -> int:
        chunks = 0
        async with client.stream(
            "POST", "/v1/completions", json={**body, "seed": i}, headers=vllm_server.headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=120) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(NUM_DISCONNECTS - 1)]
            # One client stays until every request is running, to see the cache in use.
            async with client.stream(
                "POST", "/v1/completions", json={**body, "seed": 99}, headers=vllm_server.headers
            ) as response:
                async for _ in response.aiter_lines():
                    running = await asyncio.to_thread(
                        vllm_server.gauge, "vllm:num_requests_running"
                    )
                    kv = await asyncio.to_thread(vllm_server.gauge, "vllm:kv_cache_usage_perc")
                    # The most seen while this request runs (it may finish before the deadline;
                    # past it, polling stops once some use was seen: a loaded machine may be
                    # slow to stream the first tokens).
                    busy["running"] = max(busy.get("running", 0), running)
                    busy["kv"] = max(busy.get("kv", 0), kv)
                    seen = busy["running"] >= 1 and busy["kv"] > 0
                    if running >= NUM_DISCONNECTS or (seen and time.monotonic() > deadline):
                        break
            return await asyncio.gather(*tasks)

    deadline = time.monotonic() + 60
    chunks = asyncio.run(run())
    assert all(c >= 3 for c in chunks)
    assert busy["running"] >= 1 and busy["kv"] > 0, f"the cache never showed use: {busy}"
    freed = wait_until(lambda: engine_idle(vllm_server), timeout=60)
    assert freed, (
        f"requests still running or KV cache in use after the clients left: "
        f"running={vllm_server.gauge('vllm:num_requests_running')} "
        f"kv={vllm_server.gauge('vllm:kv_cache_usage_perc')}{vllm_server.context()}"
    )
    # Aborted, not finished: a request the engine ran to max_tokens counts as finished by length
    # (an aborted one is dropped from the front end's statistics). The client that stays may
    # have read its request to the end.
    finished = (
        vllm_server.gauge("vllm:request_success_total", finished_reason="length") - finished_before
    )
    assert finished <= 1, f"{finished} requests ran to max_tokens after their clients left"
