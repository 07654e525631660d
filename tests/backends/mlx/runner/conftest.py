"""Fixtures of the MLX runner tests: a vLLM config with request states for the schedule-driven
unit tests (the tiny family checkpoints are in tests/backends/conftest.py)."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.schedules import BS
from vllm_metal.backends.mlx.runner.request_state import RequestStates


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    model = str(tiny_model_dir("qwen3"))
    return EngineArgs(model=model, max_model_len=256, max_num_seqs=8).create_engine_config()


@pytest.fixture
def states(vllm_config) -> RequestStates:
    return RequestStates(vllm_config, [BS])
