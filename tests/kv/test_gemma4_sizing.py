"""Proves the KV budget of real-size Gemma 4 models counts both head sizes and the sliding
windows, computed with the plugin's own sizing (no download, nothing allocated): E2B (mlx-lm's
default `gemma4_text` sizes: 35 layers of which the last 20 read earlier layers' K/V, one KV head,
256 wide in the sliding layers and 512 in the full ones, window 512) on a 16 GB Mac, and a
31B-shaped model (60 layers, 16 KV heads of 256 in the sliding layers, 4 of 512 in the full ones,
whose values are their keys, window 1024) on a 48 GB Mac, both 4-bit, with a 32k context (a
32k request of the 31B holds 6.4 GiB of bfloat16 K/V beside its 16 GiB of weights: more than a
32 GB Mac has left).

The KV specs are the runner's (`kv.spec.kv_cache_specs` over the family adapter's layer kinds of
mlx-lm's model, built lazily), vLLM's planner (`get_kv_cache_configs`) groups them and unifies
their pages; the pool's layout is read from that plan as the runner reads it (`KVLayout`) and
every layer's pages fit its region (`KVPool._region_shapes`, which the runner allocates by).
Assumed, as in `test_state_sizing.py`: the recommended working set is 2/3 of the Mac's memory and
the activation peak 1 GiB.
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
BLOCK_SIZE = 16

SIZES = {
    "e2b": {},  # mlx-lm's defaults
    "31b": {
        "hidden_size": 5376,
        "num_hidden_layers": 60,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
}
MAC_GIB = {"e2b": 16, "31b": 48}


def _config_only_checkpoint(out: Path, size: str) -> Path:
    """config.json (the text model, as mlx-lm's args give it) and tokenizer files: what vLLM
    reads at startup."""
    from mlx_lm.models.gemma4_text import ModelArgs

    from tests.fixtures.tiny_gemma4 import tiny_gemma4_text_config
    from vllm_metal.testing.tiny_models import write_checkpoint_files

    args = ModelArgs(**SIZES[size])
    fields = {k: v for k, v in vars(args).items() if k != "model_type"}
    config = {**tiny_gemma4_text_config("dense", dtype="bfloat16"), **fields}
    config.pop("per_layer_config", None)  # the published layout: global_head_dim
    config["max_position_embeddings"] = 131072
    return write_checkpoint_files(out, config)


def _lazy_quantized_adapter(checkpoint: Path):
    """The family adapter over mlx-lm's model of the checkpoint, its weights never evaluated (MLX
    is lazy), quantized to 4 bits with mlx-lm's own predicate."""
    import mlx.core as mx
    from mlx_lm.models.gemma4_text import Model, ModelArgs
    from mlx_lm.utils import quantize_model

    from vllm_metal.models.families.gemma4 import Adapter

    config = json.loads((checkpoint / "config.json").read_text())
    model = Model(ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    return Adapter(model, config)


@pytest.mark.parametrize("size", ["e2b", "31b"])
def test_a_real_size_gemma4_serves_a_full_context_on_a_mac(tmp_path, size):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    from vllm_metal.kv.pool import KVLayout, KVPool
    from vllm_metal.kv.spec import kv_cache_specs, memory_layer_names

    checkpoint = _config_only_checkpoint(tmp_path / size, size)
    config = EngineArgs(
        model=str(checkpoint), max_model_len=MAX_MODEL_LEN, dtype="bfloat16", block_size=BLOCK_SIZE
    ).create_engine_config()
    adapter = _lazy_quantized_adapter(checkpoint)
    args = adapter.model.args
    kinds = adapter.layer_kinds()
    names = adapter.attention_layer_names
    own_kv = args.num_hidden_layers - args.num_kv_shared_layers
    assert sum(kind.kv_source is None for kind in kinds) == own_kv

    model = config.model_config
    specs = kv_cache_specs(
        names,
        kinds,
        block_size=BLOCK_SIZE,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_dim=model.get_head_size(),
        dtype=torch.bfloat16,
        cache_config=config.cache_config,
    )
    assert len(specs) == own_kv
    full = {s.head_size for s in specs.values() if getattr(s, "sliding_window", None) is None}
    assert full == {args.global_head_dim}
    sliding = {s.head_size for s in specs.values() if getattr(s, "sliding_window", None)}
    assert sliding == {args.head_dim}

    # One request of the whole context holds the full layers' whole context and the sliding
    # layers' window only: much less than if every layer kept its whole context.
    one_request = sum(spec.max_memory_usage_bytes(config) for spec in specs.values())
    whole = sum(
        math.ceil(MAX_MODEL_LEN / spec.block_size) * spec.page_size_bytes for spec in specs.values()
    )
    assert one_request < whole / 2, (one_request / GIB, whole / GIB)

    weights = adapter.weight_bytes
    budget = int(MAC_GIB[size] * GIB * 2 / 3 * UTILIZATION)
    kv_bytes = budget - weights - ACTIVATION_PEAK
    assert one_request <= kv_bytes, (size, weights / GIB, kv_bytes / GIB, one_request / GIB)

    # vLLM's planner fits a 32k request in that budget (it raises otherwise), in the layout the
    # MLX backend declares; its groups of the narrower rows hold more tokens per block.
    resolve_kv_cache_layout(config, [["LBNHC"]], specs.values())
    (plan,) = get_kv_cache_configs(config, [specs], [kv_bytes])
    block_sizes = {
        group.kv_cache_spec.block_size: type(group.kv_cache_spec).__name__
        for group in plan.kv_cache_groups
    }
    assert len(block_sizes) == 2 and BLOCK_SIZE in block_sizes, block_sizes
    assert len({group.kv_cache_spec.page_size_bytes for group in plan.kv_cache_groups}) == 1

    # The runner reads the plan: the shared layers read their sources' regions, and every layer's
    # pages (its own heads and head size, its group's block size) fill its region exactly.
    layout = KVLayout.from_config(plan, memory_layer_names(names, kinds))
    assert layout.block_size == BLOCK_SIZE
    for i, kind in enumerate(kinds):
        if kind.kv_source is not None:
            assert layout.region_of_layer[i] == layout.region_of_layer[kind.kv_source]
    shapes = [kind.kv_shape(0, 0) for kind in kinds]
    regions = KVPool._region_shapes(layout, (0, 0), shapes)
    assert len({math.prod(shape) for shape in regions}) == 1
