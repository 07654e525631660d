"""Tiny random-weight mixture-of-experts checkpoints in Hugging Face layout: Qwen3-MoE, Mixtral and
Qwen2-MoE (shared expert), each loading in transformers, vLLM and mlx-lm.

The config is transformers' own config class for the architecture, saved as transformers 5 saves it
(``style="transformers"``: `rope_theta` only inside `rope_parameters`, Qwen3-MoE's expert count as
`num_local_experts`), or with the keys real hub checkpoints carry (``style="hub"``: top-level
`rope_theta`, Qwen3-MoE's `num_experts`), which stock mlx-lm (and so `mlx_lm.convert`) needs.
Weights are written per expert, as transformers saves them (`mlp.experts.{e}.{gate,up,down}_proj`,
Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`); mlx-lm's `sanitize` stacks them for its
`SwitchGLU`. Matrices are drawn from N(0, 0.3) so greedy decoding does not collapse, and the router
from the same spread, so its logits are several units apart and different tokens pick different
experts (tests check that on transformers' router logits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.tiny_models import DTYPES, write_checkpoint
from vllm_metal.testing.tiny_tokenizer import (
    BOS_TOKEN,
    EOT_TOKEN,
    IM_END,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    token_id,
)

MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
STYLES = ("transformers", "hub")

_CONFIG_CLASSES = {
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
}
_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}


def tiny_moe_config(
    arch: str,
    *,
    dtype: str = "float32",
    style: str = "transformers",
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 128,
    shared_expert_intermediate_size: int = 128,
    rope_theta: float = 10000.0,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of a tiny MoE checkpoint, as transformers' config class writes it (``style``
    "transformers") or with real hub checkpoints' key names ("hub")."""
    if arch not in MOE_ARCHS:
        raise ValueError(f"unknown MoE arch {arch!r}; choose from {MOE_ARCHS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    if style not in STYLES:
        raise ValueError(f"unknown config style {style!r}; choose from {STYLES}")
    if arch in ("mixtral", "qwen2_moe") and hidden_size != num_heads * head_dim:
        # mlx-lm's Mixtral and Qwen2-MoE derive head_dim from hidden_size / num_heads.
        raise ValueError(f"{arch} needs hidden_size == num_heads * head_dim")
    import transformers

    common: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],  # save_pretrained takes it from the model class
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "num_experts_per_tok": top_k,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [token_id(IM_END), token_id(EOT_TOKEN)],
        "pad_token_id": token_id(PAD_TOKEN),
        "dtype": dtype,
    }
    if arch == "mixtral":
        specific = {"num_local_experts": num_experts, "intermediate_size": moe_intermediate_size}
    else:
        specific = {
            "num_experts": num_experts,
            "moe_intermediate_size": moe_intermediate_size,
            "intermediate_size": shared_expert_intermediate_size,  # dense layers (none here)
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            # Qwen3-MoE checkpoints renormalise the top-k weights, Qwen1.5/2-MoE ones do not
            # (mlx-lm's Qwen2-MoE cannot).
            "norm_topk_prob": arch == "qwen3_moe",
        }
        if arch == "qwen2_moe":
            specific["shared_expert_intermediate_size"] = shared_expert_intermediate_size
            specific["qkv_bias"] = True
    config_class = getattr(transformers, _CONFIG_CLASSES[arch])
    # What `save_pretrained` writes: the diff against the class defaults plus the fixed keys.
    config = json.loads(config_class(**common, **specific).to_json_string(use_diff=True))
    if style == "hub":
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope["rope_theta"]
        config["rope_scaling"] = None
        if arch == "qwen3_moe":
            config["num_experts"] = config.pop("num_local_experts")
    return config


def _random_weights(
    arch: str, config: dict[str, Any], seed: int, weight_std: float, router_std: float
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors, one set per expert."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    experts = config.get("num_experts", config.get("num_local_experts"))
    inter = config["intermediate_size" if arch == "mixtral" else "moe_intermediate_size"]

    def matrix(rows: int, cols: int, std: float = weight_std) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size=(dim,))).astype(np.float32)

    weights = {"model.embed_tokens.weight": matrix(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = matrix(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = matrix(hidden, q_dim)
        if arch == "qwen3_moe":
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if arch == "qwen2_moe":
            for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                weights[p + f"self_attn.{name}_proj.bias"] = rng.normal(
                    0.0, weight_std, size=(dim,)
                ).astype(np.float32)
        if arch == "mixtral":
            moe = p + "block_sparse_moe."
            weights[moe + "gate.weight"] = matrix(experts, hidden, router_std)
            for e in range(experts):
                weights[moe + f"experts.{e}.w1.weight"] = matrix(inter, hidden)  # gate
                weights[moe + f"experts.{e}.w2.weight"] = matrix(hidden, inter)  # down
                weights[moe + f"experts.{e}.w3.weight"] = matrix(inter, hidden)  # up
            continue
        moe = p + "mlp."
        weights[moe + "gate.weight"] = matrix(experts, hidden, router_std)
        for e in range(experts):
            weights[moe + f"experts.{e}.gate_proj.weight"] = matrix(inter, hidden)
            weights[moe + f"experts.{e}.up_proj.weight"] = matrix(inter, hidden)
            weights[moe + f"experts.{e}.down_proj.weight"] = matrix(hidden, inter)
        if arch == "qwen2_moe":
            shared = config["shared_expert_intermediate_size"]
            weights[moe + "shared_expert.gate_proj.weight"] = matrix(shared, hidden)
            weights[moe + "shared_expert.up_proj.weight"] = matrix(shared, hidden)
            weights[moe + "shared_expert.down_proj.weight"] = matrix(hidden, shared)
            weights[moe + "shared_expert_gate.weight"] = matrix(1, hidden)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = matrix(config["vocab_size"], hidden)
    return weights


def write_tiny_moe(
    out_dir: str | Path,
    arch: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    router_std: float = 0.3,
    **config_kwargs: Any,
) -> Path:
    """Write a random-weight MoE checkpoint of ``arch`` in HF layout to ``out_dir``; return it.

    ``config_kwargs`` (style, sizes, ``rope_theta``, ...) go to :func:`tiny_moe_config`. Files as
    `tiny_models.write_tiny_model` writes them (config, generation config, safetensors, the tiny
    tokenizer; a ``vocab_size`` above its 768 entries leaves the extra ids without vocabulary
    entries). ``rope_theta`` defaults to 10,000, not an architecture's default (1,000,000 for
    mlx-lm's Mixtral and Qwen2-MoE), so a theta lost on the way shows.
    """
    config = tiny_moe_config(arch, dtype=dtype, **config_kwargs)
    weights = _random_weights(arch, config, seed, weight_std, router_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_moe",
        description="Write a tiny random-weight MoE checkpoint and print its path.",
    )
    parser.add_argument("--arch", required=True, choices=MOE_ARCHS)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--style", default="transformers", choices=STYLES)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_moe(args.out, args.arch, dtype=args.dtype, seed=args.seed, style=args.style)
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
