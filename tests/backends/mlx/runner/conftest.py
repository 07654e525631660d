"""Fixtures of the runner tests: tiny checkpoints (written once per session) and a vLLM config
with request states for the schedule-driven unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.backends.mlx.runner.schedules import BS
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.testing.tiny_models import write_tiny_model

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runner-models")
    return {arch: write_tiny_model(root / arch, arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    model = str(tiny_model_dir("qwen3"))
    return EngineArgs(model=model, max_model_len=256, max_num_seqs=8).create_engine_config()


@pytest.fixture
def states(vllm_config) -> RequestStates:
    return RequestStates(vllm_config, [BS])
