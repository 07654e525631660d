"""Proves transformers 5 configs reach mlx-lm with the keys it reads: a RoPE base nested in
`rope_parameters` (flat, or keyed by layer type when every type shares it, as OLMo 3 writes it) becomes
`rope_theta`; per-layer-type bases that differ (Gemma 3) and configs that already carry the key are left
alone. GLM-4.7-Flash's per-layer `mlp_layer_types` becomes the dense-layer count mlx-lm reads."""

from __future__ import annotations

import pytest
from mlx_lm.utils import _get_classes
from transformers import AutoConfig

from vllm_metal.models.hf_config import mlx_lm_overrides

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def _saved(model_type: str, **kwargs) -> dict:
    """The config dict as transformers 5's `save_pretrained` writes it."""
    return AutoConfig.for_model(model_type, **SMALL, **kwargs).to_dict()


def _overrides(config: dict) -> dict:
    return mlx_lm_overrides(config, _get_classes(config)[1])


def test_olmo3_per_layer_type_rope_base_becomes_rope_theta() -> None:
    config = _saved("olmo3", sliding_window=8)  # OLMo 3's one base, 5e5, on both layer types
    assert "rope_theta" not in config
    assert set(config["rope_parameters"]) == {"sliding_attention", "full_attention"}
    assert _overrides(config) == {"rope_theta": 500000.0}


def test_a_flat_rope_base_becomes_rope_theta() -> None:
    config = _saved("qwen3", rope_theta=4321.0)
    config.pop("rope_theta", None)
    assert _overrides(config) == {"rope_theta": 4321.0}


def test_per_layer_type_bases_that_differ_are_not_merged() -> None:
    config = {
        "model_type": "olmo3",
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    }
    assert _overrides(config) == {}


def test_a_config_that_has_rope_theta_is_left_alone() -> None:
    config = _saved("olmo3", sliding_window=8)
    config["rope_theta"] = 99.0
    assert _overrides(config) == {}


def test_glm4_moe_lite_dense_layers_become_first_k_dense_replace() -> None:
    config = _saved(
        "glm4_moe_lite", mlp_layer_types=["dense", "dense", "sparse", "sparse"], q_lora_rank=32
    )
    assert "first_k_dense_replace" not in config
    assert _overrides(config)["first_k_dense_replace"] == 2


def test_a_layer_pattern_mlx_lm_cannot_build_is_refused_by_name() -> None:
    config = _saved(
        "glm4_moe_lite", mlp_layer_types=["dense", "sparse", "dense", "sparse"], q_lora_rank=32
    )
    with pytest.raises(ValueError, match="mlp_layer_types"):
        _overrides(config)


def test_rope_scaling_kept_only_in_rope_parameters_becomes_rope_scaling() -> None:
    """Llama 3's scaled RoPE saved by transformers 5: without the mapping mlx-lm would build plain
    RoPE and run long contexts at other positions than transformers."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = _saved("llama", rope_parameters={**scaling, "rope_theta": 500000.0})
    config.pop("rope_scaling", None)
    assert _overrides(config) == {"rope_theta": 500000.0, "rope_scaling": scaling}


def test_plain_rope_maps_to_no_scaling_only_where_mlx_lm_requires_the_field() -> None:
    from mlx_lm.models.exaone4 import ModelArgs

    config = _saved("qwen3", rope_theta=4321.0)
    assert "rope_scaling" not in _overrides(config)  # optional in mlx-lm's Qwen3
    exaone = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert mlx_lm_overrides(exaone, ModelArgs)["rope_scaling"] is None  # required there
