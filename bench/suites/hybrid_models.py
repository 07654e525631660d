"""The hybrid suite's checkpoints: Qwen3-Next, Qwen3.5 (dense), Granite 4.0-H, DeepSeek-V3 and
Gemma 4 (text) at a benchmark size with random weights (the tests' tiny ones with --quick), and their descriptions
(parameters, state and KV bytes per request)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
VOCAB = 32000
MOE = {"num_experts": 8, "top_k": 2}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_next": {
        "num_layers": 8,
        "full_attention_interval": 4,
        "hidden_size": 1024,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        **MOE,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": VOCAB,
    },
    # Qwen3.5-0.8B's layers (its config.json: hidden 1024, 8 query / 2 KV heads of 256 with
    # M-RoPE sections 11, 11, 10 over the rotated quarter, 16 key / 16 value heads of 128 in the
    # Gated DeltaNet layers, a dense SwiGLU MLP of 3584, tied embeddings), 8 of them instead of 24
    # and the suite's 32,000-row vocabulary instead of 248,320.
    "qwen3_5": {
        "num_layers": 8,
        "full_attention_interval": 4,
        "hidden_size": 1024,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 256,
        "mrope_section": [11, 11, 10],
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "intermediate_size": 3584,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
    },
    "granite": {
        "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
        "hidden_size": 1024,
        "num_heads": 16,
        "num_kv_heads": 4,  # attention head size: hidden / heads = 64
        "attention_multiplier": 1 / 64,  # Granite's 1 / head_dim
        "mamba_n_heads": 32,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        **MOE,
        "intermediate_size": 512,
        "shared_intermediate_size": 512,
        "vocab_size": VOCAB,
    },
    "deepseek_v3": {
        "num_layers": 8,
        "first_k_dense_replace": 1,
        "hidden_size": 1024,
        "num_heads": 16,
        "q_lora_rank": 384,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": MOE["num_experts"],
        "top_k": MOE["top_k"],
        "n_shared_experts": 1,
        "moe_intermediate_size": 512,
        "intermediate_size": 2048,
        "vocab_size": VOCAB,
    },
    # Gemma 4 E2B's layers (mlx-lm's `gemma4_text` defaults: 4 sliding layers then 1 full, window
    # 512, 8 query heads, one KV head of 256 in the sliding layers and of 512 in the full ones, the
    # last 20 of 35 layers reading the K/V of the last earlier layer of their kind with a
    # double-wide MLP, per-layer inputs of 256, tied embeddings, an MLP 4x the hidden size), 10 of
    # them at hidden 1024: the last 5 read layer 3's (sliding) and layer 4's (full) K/V, as E2B's
    # shared layers follow its 15th layer, a full one. `Gemma4TextConfig` fields.
    "gemma4": {
        "num_hidden_layers": 10,
        "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
        "sliding_window": 512,
        "num_kv_shared_layers": 5,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
        "vocab_size": VOCAB,
    },
}
# vLLM's CPU MLA kernel takes 576-value latent rows only.
QUICK_KWARGS: dict[str, dict[str, Any]] = {
    "qwen3_next": {},
    "qwen3_5": {},
    "granite": {"mamba_n_groups": 1},
    "deepseek_v3": {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
    },
    "gemma4": {},
}
WEIGHT_STD = 0.02
STDS = {
    "qwen3_next": {"weight_std": WEIGHT_STD, "router_std": WEIGHT_STD},
    "qwen3_5": {"weight_std": WEIGHT_STD},
    "granite": {"weight_std": WEIGHT_STD, "embed_std": WEIGHT_STD / 2},
    "deepseek_v3": {"weight_std": WEIGHT_STD, "router_std": WEIGHT_STD},
    # Matrices from N(0, 0.02); embeddings and norm scales from the tests' Gemma init (the
    # embedding's N(0, 0.05), scaled by sqrt(hidden) in the model; post-sublayer norms around 7)
    # but the query and key norms' scales, N(0.5, 0.05) instead of the tests' N(2, 0.3). Gemma 4
    # does not scale attention logits (scale 1): with scales of 2 a logit over 256-wide heads has
    # a spread of ~64, every softmax is nearly an argmax, and the model is so ill-conditioned that
    # transformers' own float32 and float64 forwards of it differ by up to 0.23 in a next token's
    # logprob and pick other greedy tokens; with 0.5 (spread ~4 and ~6 on the 512-wide heads)
    # they differ by 1e-4 and 64 greedy tokens are 64 distinct ones.
    "gemma4": {"weight_std": WEIGHT_STD, "init": [[r"self_attn\.[qk]_norm", 0.5, 0.05]]},
}


# ------------------------------------------------------------------------------ checkpoints


def write_hybrid_model(work: Path, family: str, quick: bool, seed: int = 0) -> Path:
    """Write (or reuse) a family's benchmark checkpoint (`--quick`: the tests' tiny one, Granite
    with one group; Qwen3.5 in the text-only `Qwen3_5ForCausalLM` layout; Gemma 4 the E2B-like
    dense `Gemma4ForCausalLM`)."""
    from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_v3
    from tests.fixtures.tiny_gemma4 import write_tiny_gemma4
    from tests.fixtures.tiny_granitemoehybrid import write_tiny_granitemoehybrid
    from tests.fixtures.tiny_qwen3_5 import write_tiny_qwen3_5
    from tests.fixtures.tiny_qwen3_next import write_tiny_qwen3_next

    writer = {
        "qwen3_next": write_tiny_qwen3_next,
        "qwen3_5": functools.partial(write_tiny_qwen3_5, layout="causal_lm"),
        "granite": write_tiny_granitemoehybrid,
        "deepseek_v3": write_tiny_deepseek_v3,
        "gemma4": functools.partial(write_tiny_gemma4, variant="dense"),
    }[family]
    name = f"{family}-tiny" if quick else f"{family}-hybrid-random"
    path = Path(work) / "models" / f"{name}-{DTYPE}"
    if quick:
        kwargs: dict[str, Any] = dict(QUICK_KWARGS[family])
    else:
        kwargs = {**SHAPES[family], **STDS[family]}
    stamp = {"kind": family, "kwargs": kwargs, "dtype": DTYPE, "seed": seed, "format": 1}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    writer(path, dtype=DTYPE, seed=seed, **kwargs)
    if not quick:
        from bench.harness.checkpoints import pad_tokenizer

        pad_tokenizer(path / "tokenizer.json", kwargs["vocab_size"])
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


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
