"""Architectures this project does not verify are refused at startup, by name, when mlx-lm cannot
load them as transformers saved them or their first steps fail (`runner/self_check.py`), instead
of dying with a bare traceback: tiny checkpoints written by transformers' own `save_pretrained`
of four architectures mlx-lm 0.32.2 implements that fail today, each at the stage that fails.
- EXAONE 4.0: transformers 5 writes `sliding_window_pattern` as a number where mlx-lm reads a
  string of layer letters (loading);
- Apertus: mlx-lm requires `mlp_bias`, `post_norm` and `qk_norm`, which transformers' config does
  not write (loading);
- SmolLM3: mlx-lm computes its attention without `scaled_dot_product_attention` (loading);
- Granite: its mlx-lm decoder takes no input embeddings and scales them itself (the warm-up).
The runner is driven in-process as the engine core drives it (no engine); one checkpoint also
goes through a real engine start (`full`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_metal.backends.mlx.runner.self_check import UnverifiedModelError

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}
# model_type -> (architecture, extra config fields, the stage that fails, words of the cause)
BROKEN = {
    "exaone4": (
        "Exaone4ForCausalLM",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
        "loading it with mlx-lm",
        "has no len()",
    ),
    "apertus": ("ApertusForCausalLM", {}, "loading it with mlx-lm", "qk_norm"),
    "smollm3": ("SmolLM3ForCausalLM", {}, "loading it with mlx-lm", "scaled_dot_product_attention"),
    "granite": ("GraniteForCausalLM", {}, "the warm-up", "takes no input embeddings"),
}


def _write(root: Path, model_type: str) -> Path:
    from transformers import AutoConfig

    from vllm_metal.testing.tiny_models import base_config, write_transformers_checkpoint

    architecture, extra, _, _ = BROKEN[model_type]
    fields = {**base_config(), **SIZES, **extra}
    config = json.loads(AutoConfig.for_model(model_type, **fields).to_json_string(use_diff=True))
    config |= {"model_type": model_type, "architectures": [architecture]}
    return write_transformers_checkpoint(root / model_type, config)


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("broken")
    return {model_type: _write(root, model_type) for model_type in BROKEN}


@pytest.mark.parametrize("model_type", sorted(BROKEN))
def test_an_unverified_architecture_that_fails_is_refused_by_name(broken, model_type):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner

    architecture, _, stage, cause = BROKEN[model_type]
    config = EngineArgs(
        model=str(broken[model_type]), max_model_len=128, max_num_seqs=2
    ).create_engine_config()
    runner = MLXModelRunner(config)
    with pytest.raises(UnverifiedModelError) as refused:
        runner.load_model()
        runner.warm_up()
    message = str(refused.value)
    assert (
        f"({model_type}, {architecture}) is an architecture vllm-metal does not verify" in message
    )
    assert stage in message and cause in message, message


@pytest.mark.slow
@pytest.mark.full
def test_the_engine_start_is_refused_with_the_named_cause(broken):
    from tests.backends.mlx.runner.jobs import greedy, run_engine_job

    with pytest.raises(RuntimeError) as failed:
        run_engine_job(broken["exaone4"], [{"prompts": [[1, 2, 3]], "params": [greedy(2)]}])
    assert "(exaone4, Exaone4ForCausalLM) is an architecture vllm-metal does not verify" in str(
        failed.value
    )
