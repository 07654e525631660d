"""Proves the KV/state budget and block sizing of real-size Qwen3.5 models work on the Macs people
run them on, computed with the plugin's own sizing (no download, nothing allocated): a 27B
(24 query heads, 4 KV heads of 256, 48 value heads in the linear layers) on a 32 GB Mac and a 9B
on a 16 GB Mac, 4-bit, with a 32k context.

The config is vLLM's (the platform aligns the block size so an attention block holds a state
page); the KV specs are the runner's (`kv.spec.kv_cache_specs` over the layer kinds and names of
mlx-lm's model, built lazily, so no weight is ever materialised); the weights are that model
quantized as `mlx_lm.convert` quantizes it (`parameter_bytes`); the budget is the worker's formula
(`gpu_memory_utilization` of Metal's recommended working set, minus weights and the activation
peak); vLLM's own planner (`get_kv_cache_configs`) must fit a full-context request in it.
Assumed, not measured here: the recommended working set is 2/3 of the Mac's memory (what macOS
reports on 16 and 32 GB machines, the low end of its range) and the activation peak is 1 GiB.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

GIB = 2**30
MAX_MODEL_LEN = 32768
ACTIVATION_PEAK = GIB
UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization

# Text configs as the published checkpoints carry them (sizes only).
_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128}
SIZES = {
    "27b": {
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 17408,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        **_LINEAR,
    },
    "9b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 12288,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        **_LINEAR,
    },
}
MAC_GIB = {"27b": 32, "9b": 16}


def _config_only_checkpoint(out: Path, size: str) -> Path:
    """config.json (published wrapper layout) and tokenizer files: what vLLM reads at startup."""
    from tests.fixtures.tiny_qwen3_5 import tiny_qwen3_5_config
    from vllm_metal.testing.tiny_models import write_checkpoint_files

    config = tiny_qwen3_5_config("wrapper", dtype="bfloat16")
    text = config["text_config"]
    text |= SIZES[size]
    layers = text["num_hidden_layers"]
    text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                           for i in range(layers)]  # fmt: skip
    text["vocab_size"] = 248320
    text["max_position_embeddings"] = 262144
    config["vision_config"]["out_hidden_size"] = text["hidden_size"]
    return write_checkpoint_files(out, config)


def _lazy_quantized_adapter(checkpoint: Path):
    """The family adapter over mlx-lm's model of the checkpoint, its weights never evaluated (MLX
    is lazy), quantized to 4 bits with mlx-lm's own predicate."""
    import mlx.core as mx
    from mlx_lm.models.qwen3_5 import Model, ModelArgs
    from mlx_lm.utils import quantize_model

    from vllm_metal.models.families.qwen3_5 import Adapter

    config = json.loads((checkpoint / "config.json").read_text())
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    return Adapter(model.language_model, config["text_config"])


@pytest.mark.parametrize("size", ["27b", "9b"])
def test_a_real_size_qwen3_5_serves_a_full_context_on_a_mac(tmp_path, size):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from vllm_metal.kv.spec import kv_cache_specs

    checkpoint = _config_only_checkpoint(tmp_path / size, size)
    config = EngineArgs(
        model=str(checkpoint), max_model_len=MAX_MODEL_LEN, dtype="bfloat16"
    ).create_engine_config()
    cache, text = config.cache_config, SIZES[size]
    adapter = _lazy_quantized_adapter(checkpoint)
    kinds = adapter.layer_kinds()
    state = kinds[0].state

    # A block holds a state page, and is no larger than it must be (16-token steps).
    token_bytes = 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    page = state.page_bytes(2)
    assert cache.block_size % 16 == 0
    assert (cache.block_size - 16) * token_bytes < page <= cache.block_size * token_bytes
    assert cache.mamba_page_size_padded == cache.block_size * token_bytes

    specs = kv_cache_specs(
        adapter.attention_layer_names,
        kinds,
        block_size=cache.block_size,
        num_kv_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        dtype=torch.bfloat16,
        cache_config=cache,
    )
    assert len({spec.page_size_bytes for spec in specs.values()}) == 1  # one block pool

    weights = adapter.weight_bytes
    budget = int(MAC_GIB[size] * GIB * 2 / 3 * UTILIZATION)
    kv_bytes = budget - weights - ACTIVATION_PEAK
    one_request = sum(spec.max_memory_usage_bytes(config) for spec in specs.values())
    assert one_request <= kv_bytes, (size, weights / GIB, kv_bytes / GIB, one_request / GIB)

    # vLLM's planner fits at least one 32k request in that budget (it raises otherwise), in the
    # layout the MLX backend declares (as the engine core resolves it).
    resolve_kv_cache_layout(config, [["LBNHC"]], specs.values())
    (plan,) = get_kv_cache_configs(config, [specs], [kv_bytes])
    full_attention = sum(not kind.is_state for kind in kinds)
    group_size = len(plan.kv_cache_groups[0].layer_names)
    state_groups = math.ceil((len(kinds) - full_attention) / group_size)
    per_request = math.ceil(MAX_MODEL_LEN / cache.block_size) + state_groups
    assert plan.num_blocks >= per_request, (plan.num_blocks, per_request)
