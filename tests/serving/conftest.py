"""Real `vllm serve` subprocesses with the plugin on tiny checkpoints, shared by the serving tests.

One server slot per session: asking for another server stops the running one first, so at most one
engine runs at a time. The main server (tiny Qwen3, every feature flag) is shared by all modules.

Backends: `serving_backend` (session scope, "mlx" and "mps") parametrizes the main server and the
per-family servers, so every test that uses them runs on both (the "mps" variants are marked `full`:
outside CI). Servers of what only the MLX backend serves (LoRA, pooling, GPT-OSS, speech, vision, KV
offloading) use their own fixtures and start with VLLM_METAL_BACKEND=mlx whatever the environment
says. Tests are ordered by backend, then shared-server before own-server tests, so each server starts
once per backend.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests

from bench.harness import servers

API_KEY = "sk-vllm-metal-test"
SERVED_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64
KV_CACHE_BYTES = 64 * 2**20
# Documented in docs/configuration.md (test-suite variables).
STARTUP_TIMEOUT_S = float(os.environ.get("VLLM_METAL_TEST_SERVER_TIMEOUT", "300"))

# Every flag the suite exercises. qwen3's reasoning parser matches the tiny ChatML template
# (<think> ... </think>, and an empty pre-filled block when enable_thinking=false).
MAIN_SERVER_ARGS = (
    "--api-key",
    API_KEY,
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    # Compact JSON: without it a random-weight model fills schemas with whitespace until
    # max_tokens runs out. Naming the backend is required for this option.
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)


# The backends a served test runs on (VLLM_METAL_BACKEND); the torch backend's variants only with
# --run-full.
BACKENDS = ["mlx", "mps"]


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by session-scoped parameters
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # All tests of one backend run together, and within a backend the tests that need their own
    # server (one per model family) run after everything that shares the main server, so each
    # server starts once per backend. Correctness does not depend on this order.
    # A test that stops the main server runs after the others that share it, before any server
    # of its own replaces it.
    def order(item: pytest.Item) -> tuple[int, int]:
        if "serving" not in item.path.parts:  # after the serving suite, in their own order
            return (len(BACKENDS), 0)
        params = getattr(getattr(item, "callspec", None), "params", {})
        backend = BACKENDS.index(params.get("serving_backend", "mlx"))
        if item.get_closest_marker("own_server") is not None:
            return (backend, 2)
        return (backend, int(item.get_closest_marker("stops_main_server") is not None))

    items.sort(key=order)


# The server helpers are the benchmark harness's (one launcher for tests and benchmarks); these
# names stay importable from here.
Server = servers.Server
free_port = servers.free_port
log_tail = servers.log_tail
stop_server = servers.stop_server
start_server = functools.partial(
    servers.start_server,
    max_model_len=MAX_MODEL_LEN,
    kv_cache_bytes=KV_CACHE_BYTES,
    timeout=STARTUP_TIMEOUT_S,
)


class ServerSlot:
    """Holds at most one running server; asking for a different one stops the current first."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.key: tuple[Any, ...] | None = None
        self.server: Server | None = None
        self.starts = 0

    def get(
        self,
        key: tuple[Any, ...],
        model_dir: Path,
        *,
        served_name: str,
        api_key: str | None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Server:
        if self.server is not None and self.key == key:
            if not self.server.alive():
                pytest.fail(f"the shared vllm serve died earlier{self.server.context()}")
            return self.server
        self.close()
        self.starts += 1
        backend = (env or {}).get("VLLM_METAL_BACKEND", "mlx")
        log_path = self.log_dir / f"server-{self.starts:02d}-{served_name}-{backend}.log"
        self.server = start_server(
            model_dir,
            log_path,
            served_name=served_name,
            api_key=api_key,
            extra_args=extra_args,
            env=env,
        )
        self.key = key
        return self.server

    def close(self) -> None:
        if self.server is not None:
            stop_server(self.server)
        self.server = None
        self.key = None


_SLOTS: list[ServerSlot] = []


@pytest.fixture(scope="session")
def server_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerSlot]:
    slot = ServerSlot(tmp_path_factory.mktemp("vllm-serve-logs"))
    _SLOTS.append(slot)
    try:
        yield slot
    finally:
        slot.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # The serving tests run together (the ordering above, one xdist worker): after the last of
    # them the server stops instead of idling beside the rest of the session.
    if "serving" in item.path.parts and (nextitem is None or "serving" not in nextitem.path.parts):
        for slot in _SLOTS:
            slot.close()


@pytest.fixture(
    scope="session", params=["mlx", pytest.param("mps", marks=pytest.mark.full)], ids=BACKENDS
)
def serving_backend(request: pytest.FixtureRequest) -> str:
    """The backend (VLLM_METAL_BACKEND) of the main and per-family servers: "mlx", or "mps" (the
    torch backend; its variants are marked `full`). Session scope makes pytest group the tests by
    backend. A test can pin one with `@pytest.mark.parametrize("serving_backend", ["mps"],
    indirect=True)`."""
    return request.param


def backend_env(backend: str) -> dict[str, str]:
    return {"VLLM_METAL_BACKEND": backend}


@pytest.fixture
def vllm_server(
    server_slot: ServerSlot, tiny_model_dir: Callable[..., Path], serving_backend: str
) -> Server:
    """The main server: tiny Qwen3 with API key, auto tool choice (hermes) and qwen3 reasoning, on
    the `serving_backend`.

    Started on first use and kept for the session (function scope only so the slot can hand the
    engine to a per-family server in between; it is not restarted while tests keep using it).
    """
    model_dir = tiny_model_dir("qwen3")
    return server_slot.get(
        ("main", serving_backend, str(model_dir)),
        model_dir,
        served_name=SERVED_NAME,
        api_key=API_KEY,
        extra_args=MAIN_SERVER_ARGS,
        env=backend_env(serving_backend),
    )


@pytest.fixture
def check(vllm_server: Server) -> Callable[[requests.Response, int], Any]:
    """`check(response, status)` asserts the status (with the server's log on failure) and returns
    the decoded JSON body."""

    def _check(response: requests.Response, status: int = 200) -> Any:
        assert response.status_code == status, (
            f"{response.request.method} {response.url} -> {response.status_code}, "
            f"wanted {status}: {response.text[:2000]}{vllm_server.context()}"
        )
        with contextlib.suppress(json.JSONDecodeError):
            return response.json()
        return response.text

    return _check


@pytest.fixture
def client(vllm_server: Server) -> Any:
    """The official OpenAI client pointed at the main server."""
    import openai

    return openai.OpenAI(
        base_url=vllm_server.url("/v1"), api_key=vllm_server.api_key, timeout=120, max_retries=0
    )


@pytest.fixture
def tokenizer(vllm_server: Server) -> Any:
    """The served checkpoint's tokenizer, loaded independently of vLLM."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(vllm_server.model_dir / "tokenizer.json"))


@pytest.fixture
def whitespace_ids(tokenizer: Any) -> list[int]:
    """Ids of tokens that decode to whitespace only.

    A -100 logit_bias on them keeps grammar-constrained output of a random model short: JSON
    allows whitespace between every pair of tokens, and the model otherwise wanders there.
    """
    return [
        i
        for i in range(tokenizer.get_vocab_size())
        if (text := tokenizer.decode([i], skip_special_tokens=False)) and not text.strip()
    ]


def greedy_completion(server: Server) -> tuple[dict, dict]:
    """A greedy completion (non-streaming) whose tokens equal transformers float32 on the same
    prompt: (request body, choice)."""
    from tests.fixtures.oracles import hf_greedy

    body = {
        "model": server.model,
        "prompt": "The capital of Japan is Tokyo. It is one of the",
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text + server.context()
    choice = r.json()["choices"][0]
    expected = hf_greedy(server.model_dir, [choice["prompt_token_ids"]], 8)[0]
    assert choice["token_ids"] == expected, server.context()
    return body, choice


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "own_server: starts its own vllm serve instead of the shared main server"
    )
    config.addinivalue_line(
        "markers", "stops_main_server: ends the shared main server (after the tests sharing it)"
    )
