"""`vllm serve` with both KV offload tiers: a prompt evicted from the device pool is answered from
the host tier, and after the server is stopped and started again on the same disk directory from
the disk tier; /metrics counts the hits per tier (vLLM's `prompt_tokens_cached_by_source` and
external prefix-cache counters, and this platform's per-tier block counters). The engine-level
details (corrupt files, preemption, chunked prefill, the control without tiers) are in
tests/kv/test_offload_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.serving.conftest import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

# Tiny llama: 32 KiB per KV block; 40 blocks hold two 300-token prompts but not three.
ARGS = (
    "--kv-cache-memory-bytes",
    str(40 * 32 * 2**10),
    "--kv-offloading-size",
    "0.01",
    "--max-num-batched-tokens",
    "64",
)
_rng = np.random.default_rng(1)
A, B, C = ([int(t) for t in _rng.integers(5, 700, 300)] for _ in range(3))
CACHED = 18 * 16


def _complete(server, prompt):
    body = {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text + server.context()
    out = response.json()
    return out["choices"][0]["text"], out["usage"]


def test_a_served_prompt_comes_back_from_host_then_disk_after_a_restart(
    server_slot, tiny_model_dir, tmp_path
):
    server_slot.close()  # one engine at a time on this machine
    model = tiny_model_dir("llama")
    env = {"VLLM_METAL_SSD_CACHE_DIR": str(tmp_path / "kv")}

    def serve(log: str):
        return start_server(
            model,
            tmp_path / log,
            served_name="tiny",
            api_key=None,
            extra_args=ARGS,
            env=env,
            max_model_len=512,
        )

    server = serve("first.log")
    try:
        first, _ = _complete(server, A)
        _complete(server, B)
        _complete(server, C)  # A is evicted from the device pool
        again, _ = _complete(server, A)
        assert again == first
        assert server.gauge("vllm:prompt_tokens_cached_by_source_total", source="host") == CACHED
        assert server.gauge("vllm:kv_offload_host_hit_blocks_total") == CACHED // 16
        assert server.gauge("vllm:external_prefix_cache_hits_total") == CACHED
    finally:
        stop_server(server)

    server = serve("second.log")
    try:
        restarted, _ = _complete(server, A)
        assert restarted == first
        assert server.gauge("vllm:prompt_tokens_cached_by_source_total", source="disk") == CACHED
        assert server.gauge("vllm:prompt_tokens_cached_by_source_total", source="host") == 0
        assert server.gauge("vllm:kv_offload_disk_hit_blocks_total") == CACHED // 16
    finally:
        stop_server(server)
