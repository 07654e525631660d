"""LoRA adapters through `vllm serve`: `--lora-modules` at startup, `/v1/models`, runtime load and
unload (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`), bad adapters answered with 4xx while the server
keeps serving, and an unload that removes the adapter from the workers.

Greedy tokens of each adapter equal transformers float32 with the adapter merged by PEFT.
"""

from __future__ import annotations

import pytest

from tests.fixtures.oracles import hf_greedy
from tests.fixtures.tiny_lora import write_tiny_adapter

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

PROMPT = "The capital of Japan is Tokyo. It is one of the"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("serving-lora")
    return model, {
        "ad-a": write_tiny_adapter(model, root / "a", rank=8, seed=31),
        "ad-b": write_tiny_adapter(model, root / "b", rank=16, alpha=8, seed=32),
        "too-big": write_tiny_adapter(model, root / "too_big", rank=32, seed=33),
    }


@pytest.fixture
def server(server_slot, adapters):
    model, paths = adapters
    return server_slot.get(
        ("lora", str(model)),
        model,
        served_name="tiny-llama-base",
        api_key=None,
        extra_args=[
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "16",
            "--lora-modules",
            f"ad-a={paths['ad-a']}",
        ],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"},
    )


def _complete(server, model: str):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return server.post("/v1/completions", body)


def _check_tokens(server, adapters, name: str | None) -> None:
    model, paths = adapters
    r = _complete(server, name or server.model)
    assert r.status_code == 200, r.text + server.context()
    choice = r.json()["choices"][0]
    expected = hf_greedy(
        model, [choice["prompt_token_ids"]], NEW_TOKENS, adapter=name and paths[name]
    )[0]
    assert choice["token_ids"] == expected


def _worker_adapters(server) -> set[int]:
    r = server.post("/collective_rpc", {"method": "list_loras"})
    assert r.status_code == 200, r.text + server.context()
    return set(r.json()["results"][0])  # the worker's set arrives as a JSON list


def test_startup_adapter_is_listed_and_served(server, adapters):
    cards = {c["id"]: c for c in server.get("/v1/models").json()["data"]}
    assert cards["ad-a"]["parent"] == "tiny-llama-base"
    assert cards["ad-a"]["root"] == str(adapters[1]["ad-a"])
    _check_tokens(server, adapters, "ad-a")
    _check_tokens(server, adapters, None)


def test_runtime_load_serve_and_unload(server, adapters):
    _, paths = adapters
    before = _worker_adapters(server)
    r = server.post("/v1/load_lora_adapter", {"lora_name": "ad-b", "lora_path": str(paths["ad-b"])})
    assert r.status_code == 200, r.text + server.context()
    assert "ad-b" in {c["id"] for c in server.get("/v1/models").json()["data"]}
    _check_tokens(server, adapters, "ad-b")
    loaded = _worker_adapters(server)
    assert len(loaded - before) == 1

    r = server.post("/v1/unload_lora_adapter", {"lora_name": "ad-b"})
    assert r.status_code == 200, r.text + server.context()
    assert _worker_adapters(server) == before  # freed on the workers, not only forgotten
    r = _complete(server, "ad-b")
    assert r.status_code == 404, r.text
    _check_tokens(server, adapters, "ad-a")


def test_bad_adapters_get_4xx_and_the_server_keeps_serving(server, adapters):
    _, paths = adapters
    r = server.post(
        "/v1/load_lora_adapter", {"lora_name": "too-big", "lora_path": str(paths["too-big"])}
    )
    assert r.status_code == 400, r.text + server.context()
    assert "max_lora_rank" in r.text or "--max-lora-rank" in r.text, r.text
    r = server.post("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/no/such/dir"})
    assert r.status_code == 404, r.text + server.context()
    assert "too-big" not in {c["id"] for c in server.get("/v1/models").json()["data"]}
    assert server.alive()
    _check_tokens(server, adapters, "ad-a")
