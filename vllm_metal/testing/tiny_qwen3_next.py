"""A tiny random-weight Qwen3-Next checkpoint (`Qwen3NextForCausalLM`) in Hugging Face layout, loading
in transformers, vLLM and mlx-lm.

Qwen3-Next is a hybrid: three Gated DeltaNet (linear attention) layers to each gated full attention
layer, each layer with a sparse MoE block plus a sigmoid-gated shared expert. The tiny model keeps
that: 4 layers (3x "linear_attention", then "full_attention"), width 128, 2 query heads and 1 KV
head of 64 (a quarter rotated), 1 key and 2 value heads of 64 in the linear layers, top-2 of 4
experts.

The config is transformers' own `Qwen3NextConfig` as `save_pretrained` writes it, plus a top-level
`rope_theta`: mlx-lm 0.32.2's `ModelArgs` requires it (transformers 5 keeps it only in
`rope_parameters`, which transformers and vLLM read; same value in both, as on the hub) and places
full attention by `full_attention_interval` (kept), not `layer_types`.

Weights are stored as hub checkpoints store them, experts one by one: mlx-lm's `sanitize` stacks
them and only then transforms the rest (conv1d axes, norm offsets). The plain RMSNorms (layer,
final, q/k) scale by `1 + weight`, so those weights are drawn small around 0; the linear layers'
gated norm scales by `weight` (around 1). `A_log` is the log of a decay rate in [1, 16] (as
transformers initialises it), `dt_bias` is around 1. Matrices and the router are drawn from
N(0, 0.3) so greedy decoding does not collapse into one repeated token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.checkpoint_cli import write_checkpoint_main
from vllm_metal.testing.tiny_models import DTYPES, write_checkpoint
from vllm_metal.testing.tiny_tokenizer import (
    BOS_TOKEN,
    EOT_TOKEN,
    IM_END,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    token_id,
)


def tiny_qwen3_next_config(
    *,
    dtype: str = "float32",
    num_layers: int = 4,
    full_attention_interval: int = 4,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    partial_rotary_factor: float = 0.25,
    linear_num_key_heads: int = 1,
    linear_num_value_heads: int = 2,
    linear_key_head_dim: int = 64,
    linear_value_head_dim: int = 64,
    linear_conv_kernel_dim: int = 4,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
    intermediate_size: int = 64,
    rope_theta: float = 10000.0,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of the tiny Qwen3-Next checkpoint: what `Qwen3NextConfig.save_pretrained`
    writes, plus the top-level `rope_theta` mlx-lm requires."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    from transformers import Qwen3NextConfig

    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    config_object = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        full_attention_interval=full_attention_interval,  # what mlx-lm reads instead
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        partial_rotary_factor=partial_rotary_factor,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=linear_conv_kernel_dim,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        intermediate_size=intermediate_size,  # dense MLP layers (none here)
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=[token_id(IM_END), token_id(EOT_TOKEN)],
        pad_token_id=token_id(PAD_TOKEN),
        dtype=dtype,
    )
    config = json.loads(config_object.to_json_string(use_diff=True))
    config["architectures"] = ["Qwen3NextForCausalLM"]  # save_pretrained takes it from the model
    config["rope_theta"] = rope_theta  # mlx-lm's required field; the same value as rope_parameters'
    return config


def random_weights(
    config: dict[str, Any], seed: int = 0, weight_std: float = 0.3, router_std: float = 0.3
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the checkpoint, experts one by one."""
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_heads = config["linear_num_value_heads"]
    value_dim = value_heads * config["linear_value_head_dim"]
    conv_dim, kernel = 2 * key_dim + value_dim, config["linear_conv_kernel_dim"]
    experts, inter = config["num_experts"], config["moe_intermediate_size"]
    shared = config["shared_expert_intermediate_size"]

    def normal(*shape: int, std: float = weight_std, mean: float = 0.0) -> np.ndarray:
        return rng.normal(mean, std, size=shape).astype(np.float32)

    def offset_norm(dim: int) -> np.ndarray:  # applied as 1 + weight
        return normal(dim, std=0.1)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = offset_norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = offset_norm(hidden)
        if layer_type == "linear_attention":
            a = p + "linear_attn."
            weights[a + "in_proj_qkvz.weight"] = normal(2 * key_dim + 2 * value_dim, hidden)
            weights[a + "in_proj_ba.weight"] = normal(2 * value_heads, hidden)
            weights[a + "conv1d.weight"] = normal(conv_dim, 1, kernel, std=0.5)
            weights[a + "dt_bias"] = normal(value_heads, std=0.1, mean=1.0)
            decay = rng.uniform(1.0, 16.0, size=value_heads)
            weights[a + "A_log"] = np.log(decay).astype(np.float32)
            weights[a + "norm.weight"] = normal(config["linear_value_head_dim"], std=0.1, mean=1.0)
            weights[a + "out_proj.weight"] = normal(hidden, value_dim)
        else:
            a = p + "self_attn."
            weights[a + "q_proj.weight"] = normal(2 * heads * head_dim, hidden)  # query and gate
            weights[a + "k_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "v_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "o_proj.weight"] = normal(hidden, heads * head_dim)
            weights[a + "q_norm.weight"] = offset_norm(head_dim)
            weights[a + "k_norm.weight"] = offset_norm(head_dim)
        moe = p + "mlp."
        weights[moe + "gate.weight"] = normal(experts, hidden, std=router_std)
        for name, rows, cols, count in (
            ("experts.{}.", inter, hidden, experts),
            ("shared_expert.", shared, hidden, 1),
        ):
            for e in range(count):
                prefix = moe + name.format(e)
                weights[prefix + "gate_proj.weight"] = normal(rows, cols)
                weights[prefix + "up_proj.weight"] = normal(rows, cols)
                weights[prefix + "down_proj.weight"] = normal(cols, rows)
        weights[moe + "shared_expert_gate.weight"] = normal(1, hidden)
    weights["model.norm.weight"] = offset_norm(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def write_tiny_qwen3_next(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    router_std: float = 0.3,
    **config_kwargs: Any,
) -> Path:
    """Write the random-weight Qwen3-Next checkpoint to ``out_dir`` and return it.

    ``config_kwargs`` (sizes, ``rope_theta``, ...) go to :func:`tiny_qwen3_next_config`. Files as
    `tiny_models.write_checkpoint` writes them: config, generation config, model.safetensors and
    the tiny tokenizer. The same arguments always give byte-identical files.
    """
    config = tiny_qwen3_next_config(dtype=dtype, **config_kwargs)
    weights = random_weights(config, seed, weight_std, router_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_qwen3_next", "Qwen3-Next", write_tiny_qwen3_next, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
