"""The one MLX runner over each model kind (`model_states/`): the kind and output stage picked from
vLLM's config, the features a kind cannot run refused by their flag, and each kind's load, KV
specs, dummy steps, memory and sleep on tiny checkpoints in real MLX (no engine)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from vllm.pooling_params import PoolingParams
from vllm.v1.kv_cache_interface import CrossAttentionSpec

from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner
from vllm_metal.backends.mlx.runner.model_states import NO_INPUTS, StepInputs, select
from vllm_metal.backends.mlx.runner.model_states.encoder_only import token_type_ids


def _config(model, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = {"max_model_len": 256, "max_num_seqs": 4} | kwargs
    return EngineArgs(model=str(model), **args).create_engine_config()


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    try:
        from tests.fixtures.tiny_encoders import write_tiny_encoder
    except ImportError:  # before the fixtures moved out of the package
        from tests.fixtures.tiny_encoders import write_tiny_encoder
    return write_tiny_encoder(tmp_path_factory.mktemp("encoder") / "bert", "bert-embed")


@pytest.fixture(scope="module")
def configs(tiny_model_dir, encoder_dir, tiny_whisper_dir, tiny_idefics3_dir):
    """kind name -> a vLLM config of a tiny checkpoint of that kind (and output stage)."""
    qwen3 = tiny_model_dir("qwen3")
    return {
        "decoder": _config(qwen3),
        "decoder-pooling": _config(qwen3, runner="pooling"),
        "encoder-only": _config(encoder_dir, runner="pooling", max_model_len=64),
        "encoder-decoder": _config(tiny_whisper_dir, max_model_len=448),
        "multimodal": _config(tiny_idefics3_dir, max_model_len=2048),
    }


@pytest.mark.parametrize(
    ("name", "state", "stage"),
    [
        ("decoder", "DecoderState", "Sampling"),
        ("decoder-pooling", "DecoderState", "Pooling"),
        ("encoder-only", "EncoderOnlyState", "Pooling"),
        ("encoder-decoder", "EncoderDecoderState", "Sampling"),
        ("multimodal", "MultimodalState", "Sampling"),
    ],
)
def test_the_kind_and_the_output_stage_come_from_the_config(configs, name, state, stage) -> None:
    assert select(configs[name]).__name__ == state
    runner = MLXModelRunner(configs[name])
    assert type(runner.state).__name__ == state
    assert type(runner.output).__name__ == stage
    assert runner.state.lm_head == (stage == "Sampling")


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("encoder-only", "--enable-lora"),
        ("encoder-decoder", "--speculative-config"),
        ("decoder-pooling", "--speculative-config"),
        ("encoder-only", "--kv-transfer-config"),
    ],
)
def test_a_feature_the_kind_or_stage_lacks_is_refused_by_its_flag(configs, name, flag) -> None:
    # The platform refuses these at startup; the runner's check is the backstop behind it, so
    # the setting is put on an accepted config afterwards.
    config = copy.copy(configs[name])
    setting = {
        "--enable-lora": "lora_config",
        "--speculative-config": "speculative_config",
        "--kv-transfer-config": "kv_transfer_config",
    }[flag]
    object.__setattr__(config, setting, object())
    with pytest.raises(ValueError, match=flag):
        MLXModelRunner(config)


@pytest.mark.parametrize(
    ("name", "tasks"),
    [
        ("decoder", ("generate",)),
        ("decoder-pooling", ("embed", "token_embed")),
        ("encoder-only", ("embed", "token_embed")),
        ("encoder-decoder", ("transcription",)),
    ],
)
def test_each_kind_loads_profiles_warms_up_and_sleeps(configs, name, tasks) -> None:
    runner = MLXModelRunner(configs[name])
    runner.load_model()
    assert runner.is_loaded() and runner.get_model() is not None
    assert runner.get_supported_tasks() == tasks
    specs = runner.get_kv_cache_spec()
    if name == "encoder-only":
        assert specs == {}  # vLLM schedules each prompt whole and sizes no cache
    else:
        assert set(specs) >= set(runner.state.kv_layer_names()[:1])
        crosses = [s for s in specs.values() if isinstance(s, CrossAttentionSpec)]
        assert bool(crosses) == (name == "encoder-decoder")
    assert runner.profile_run() > 0
    runner.warm_up()
    weights = runner.memory().weights
    assert weights > 0
    runner.sleep(2)
    assert not runner.is_loaded() and runner.memory().weights == 0
    runner.wake_up(["weights"])
    assert runner.is_loaded() and runner.memory().weights == weights


def test_no_step_inputs_are_a_plain_decoder_step() -> None:
    assert StepInputs() == NO_INPUTS
    assert all(value is None for value in vars(NO_INPUTS).values())


def test_token_types_of_scored_pairs_packed_back_to_back() -> None:
    pair = PoolingParams(task="classify", extra_kwargs={"compressed_token_type_ids": 2})
    single = PoolingParams(task="classify")
    assert token_type_ids([single, single], np.array([3, 2])) is None
    types = token_type_ids([pair, single, pair], np.array([4, 2, 3]))
    assert types.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1]
