"""What the hybrid suite's checkpoints are (`hybrid_models`), from their config.json and
safetensors header: shape, layer pattern, parameters, KV bytes per token and state bytes per
request, by family."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def describe_hybrid_model(path: Path) -> dict[str, Any]:
    """Shape, layer pattern, total and active parameters (per token: everything but the experts
    the router skips and, when untied, the embedding, which is only gathered), KV bytes per token
    and state bytes per request, from config.json and the safetensors header. A dense model
    (Qwen3.5, Gemma 4 here) has `num_experts` None and its MLP's `intermediate_size`. Gemma 4's
    per-layer embedding (`embed_tokens_per_layer`) is only gathered, so it is not active."""
    from bench.harness.checkpoints import safetensors_sizes

    c = json.loads((path / "config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[c["dtype"]]
    family = {
        "qwen3_next": _gated_delta,
        "qwen3_5_text": _gated_delta,
        "granitemoehybrid": _mamba2,
        "deepseek_v3": _latent,
        "gemma4_text": _sliding,
        "lfm2": _short_conv,
    }
    shape = family[c["model_type"]](c, itemsize)
    sparse = re.compile(r"\.mlp\.experts\.|\.block_sparse_moe\.(input|output)_linear\.")
    expert_bytes = sum(v for n, v in sizes.items() if sparse.search(n))
    other = sum(v for n, v in sizes.items() if not sparse.search(n))
    tied = c.get("tie_word_embeddings", False)
    active = other - (0 if tied else sizes["model.embed_tokens.weight"])
    active -= sizes.get("model.embed_tokens_per_layer.weight", 0)
    if shape["num_experts"]:
        active += expert_bytes * c["num_experts_per_tok"] // shape["num_experts"]
    return {
        "path": str(path),
        "name": path.name,
        "architecture": c["architectures"][0],
        "dtype": c["dtype"],
        "num_layers": c["num_hidden_layers"],
        "hidden_size": c["hidden_size"],
        "num_heads": c["num_attention_heads"],
        "experts_per_token": c.get("num_experts_per_tok"),
        "vocab_size": c["vocab_size"],
        "tied_embeddings": tied,
        "num_parameters": sum(sizes.values()) // itemsize,
        "active_parameters_per_token": active // itemsize,
        **shape,
    }


def _gated_delta(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    state = c["linear_num_value_heads"] * c["linear_value_head_dim"] * c["linear_key_head_dim"]
    mixer = {
        "key_heads": c["linear_num_key_heads"],
        "value_heads": c["linear_num_value_heads"],
        "key_head_dim": c["linear_key_head_dim"],
        "value_head_dim": c["linear_value_head_dim"],
    }
    experts = None  # dense (Qwen3.5)
    if "num_experts" in c:
        experts = (c["num_experts"], c["moe_intermediate_size"],
                   c["shared_expert_intermediate_size"])  # fmt: skip
    return _with_state(
        c, itemsize, "Gated DeltaNet", mixer, c["head_dim"], state,
        conv=(c["linear_conv_kernel_dim"], 2 * key_dim + value_dim), experts=experts,
    )  # fmt: skip


def _mamba2(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    inner = c["mamba_n_heads"] * c["mamba_d_head"]
    mixer = {
        "heads": c["mamba_n_heads"],
        "head_dim": c["mamba_d_head"],
        "state": c["mamba_d_state"],
        "groups": c["mamba_n_groups"],
    }
    return _with_state(
        c, itemsize, "Mamba-2", mixer, c["hidden_size"] // c["num_attention_heads"],
        inner * c["mamba_d_state"],
        conv=(c["mamba_d_conv"], inner + 2 * c["mamba_n_groups"] * c["mamba_d_state"]),
        experts=(c["num_local_experts"], c["intermediate_size"], c["shared_intermediate_size"]),
    )  # fmt: skip


def _short_conv(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """LFM2's fields: gated short-convolution layers, whose state is the last `conv_L_cache - 1`
    inputs of the convolution (hidden-wide), and attention layers; its feed-forward width as
    LFM2 adjusts it."""
    ff = int(2 * c["intermediate_size"] / 3)
    if c.get("block_ffn_dim_multiplier") is not None:
        ff = int(c["block_ffn_dim_multiplier"] * ff)
    multiple = c["block_multiple_of"]
    ff = multiple * ((ff + multiple - 1) // multiple)
    fields = _with_state(
        {**c, "intermediate_size": ff}, itemsize, "short convolution",
        {"window": c["conv_L_cache"], "channels": c["hidden_size"]},
        c["hidden_size"] // c["num_attention_heads"], 0,
        conv=(c["conv_L_cache"], c["hidden_size"]), experts=None,
    )  # fmt: skip
    return fields


def _with_state(c: dict[str, Any], itemsize: int, mixer: str, mixer_shape: dict[str, Any],
                head_dim: int, state: int, conv: tuple[int, int],
                experts: tuple[int, int, int] | None) -> dict[str, Any]:  # fmt: skip
    """A hybrid's fields: its state layers (float32 state plus the convolution window) and
    attention layers; `experts` (count, intermediate, shared intermediate), None for a dense
    MLP."""
    layer_types = c["layer_types"]
    attention = [t for t in layer_types if t in ("full_attention", "attention")]
    state_layers = len(layer_types) - len(attention)
    kernel, conv_dim = conv
    return {
        "layer_types": layer_types,
        "mixer": mixer,
        "mixer_shape": mixer_shape,
        "state_layers": state_layers,
        "attention_layers": len(attention),
        "num_kv_heads": c["num_key_value_heads"],
        "head_dim": head_dim,
        "num_experts": experts[0] if experts else None,
        "expert_intermediate_size": experts[1] if experts else None,
        "shared_intermediate_size": experts[2] if experts else None,
        **({} if experts else {"intermediate_size": c["intermediate_size"]}),
        "kv_bytes_per_token": 2 * len(attention) * c["num_key_value_heads"] * head_dim * itemsize,
        "state_bytes_per_request": state_layers * (4 * state + (kernel - 1) * conv_dim * itemsize),
    }


def _latent(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """DeepSeek-V3's fields: every layer MLA, caching one latent row per token."""
    layers = c["num_hidden_layers"]
    dense = c["first_k_dense_replace"]
    row = c["kv_lora_rank"] + c["qk_rope_head_dim"]
    return {
        "layer_types": ["mla"] * layers,
        "mixer": "MLA",
        "mixer_shape": {
            "q_lora_rank": c["q_lora_rank"],
            "kv_lora_rank": c["kv_lora_rank"],
            "rope_dim": c["qk_rope_head_dim"],
            "nope_dim": c["qk_nope_head_dim"],
            "value_dim": c["v_head_dim"],
            "dense_layers": dense,
            "dense_intermediate_size": c["intermediate_size"],
        },
        "state_layers": 0,
        "attention_layers": layers,
        "num_kv_heads": 1,
        "head_dim": row,
        "num_experts": c["n_routed_experts"],
        "expert_intermediate_size": c["moe_intermediate_size"],
        "shared_intermediate_size": c["moe_intermediate_size"] * c["n_shared_experts"],
        "kv_bytes_per_token": layers * row * itemsize,
        "state_bytes_per_request": 0,
    }


def _sliding(c: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """Gemma 4's fields: sliding and full attention layers with their own head size and KV heads,
    the last `num_kv_shared_layers` layers computing no K/V (they read the last earlier layer of
    their kind's), each with a double-wide MLP where `use_double_wide_mlp`. `kv_bytes_per_token`
    counts the layers that compute K/V, each for every token: a sliding layer holds at most its
    window of them, more than any request of this suite holds (no state)."""
    layer_types = c["layer_types"]
    full_kv, full_head = _gemma4_full_kv_shape(c)
    shared = c.get("num_kv_shared_layers", 0)
    computing = layer_types[: len(layer_types) - shared]
    sliding = sum(t == "sliding_attention" for t in layer_types)
    row = {"sliding_attention": c["num_key_value_heads"] * c["head_dim"],
           "full_attention": full_kv * full_head}  # fmt: skip
    return {
        "layer_types": layer_types,
        "mixer": "sliding window",
        "mixer_shape": {
            "window": c["sliding_window"],
            "sliding_layers": sliding,
            "full_layers": len(layer_types) - sliding,
            "sliding_kv_heads": c["num_key_value_heads"],
            "sliding_head_dim": c["head_dim"],
            "full_kv_heads": full_kv,
            "full_head_dim": full_head,
            "kv_shared_layers": shared,
            "double_wide_mlp": bool(c.get("use_double_wide_mlp")) and shared > 0,
            "per_layer_input": c.get("hidden_size_per_layer_input") or 0,
        },
        "state_layers": 0,
        "attention_layers": len(layer_types),
        "num_kv_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_experts": None,
        "expert_intermediate_size": None,
        "shared_intermediate_size": None,
        "intermediate_size": c["intermediate_size"],
        "kv_bytes_per_token": sum(2 * row[t] * itemsize for t in computing),
        "state_bytes_per_request": 0,
    }


def _gemma4_full_kv_shape(c: dict[str, Any]) -> tuple[int, int]:
    """The full layers' KV heads and head size as mlx-lm reads them: `global_head_dim` as
    published, `num_global_key_value_heads` where the full layers' values are their keys
    (`attention_k_eq_v`); or the `per_layer_config` entries transformers 5 writes for the full
    layers instead."""
    full = [str(i) for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
    per_layer = c.get("per_layer_config") or {}

    def field(published: str | None, name: str) -> int:
        if published and c.get(published):
            return c[published]
        values = {per_layer[i][name] for i in full if name in per_layer.get(i, {})}
        return values.pop() if len(values) == 1 else c[name]

    k_eq_v = c.get("attention_k_eq_v")
    heads = field("num_global_key_value_heads" if k_eq_v else None, "num_key_value_heads")
    return heads, field("global_head_dim", "head_dim")
