"""Model loading and KV sizing: Hugging Face ids from the local hub cache, and a clear error when
not even one max-length request fits in the memory budget."""

from __future__ import annotations

import shutil

import pytest

from tests.backends.mlx.runner.jobs import greedy, run_engine_job, tokens
from tests.fixtures.oracles import hf_greedy

pytestmark = pytest.mark.slow


def _populate_hub_cache(cache_dir, repo_id: str, src) -> None:
    """Lay `src` out as huggingface_hub's cache does after a download of `repo_id`."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def test_hugging_face_id_resolves_through_hub_cache(tiny_model_dir, tmp_path, monkeypatch):
    src = tiny_model_dir("qwen2")
    cache = tmp_path / "hub"
    _populate_hub_cache(cache, "tiny-org/tiny-qwen2", src)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = [list(range(30, 50))]
    (batch,) = run_engine_job("tiny-org/tiny-qwen2", [{"prompts": prompts, "params": [greedy(12)]}])
    assert tokens(batch) == hf_greedy(src, prompts, 12)


def test_refuses_when_one_max_length_request_does_not_fit(tiny_model_dir):
    model = tiny_model_dir("qwen3")
    engine = {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 1e-5, "max_model_len": 2048}
    with pytest.raises(RuntimeError) as err:
        run_engine_job(model, [{"prompts": [[5, 6]], "params": [greedy(2)]}], engine=engine)
    message = str(err.value)
    assert "Not enough memory for one request of max_model_len=2048" in message
    assert "gpu_memory_utilization=1e-05" in message
