"""One engine config for the hand-built schedules of this folder: the tiny Qwen3 with n-gram
drafts of up to `K` tokens, and fresh request states over it for each test."""

from __future__ import annotations

import pytest

from tests.backends.mlx.runner.schedules import BS
from vllm_metal.backends.mlx.runner.request_state import RequestStates

K = 4


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2}
    return EngineArgs(
        model=str(tiny_model_dir("qwen3")),
        max_model_len=256,
        max_num_seqs=8,
        speculative_config=spec,
    ).create_engine_config()


@pytest.fixture
def states(vllm_config) -> RequestStates:
    return RequestStates(vllm_config, [BS])
