"""A tiny random-weight DeepSeek-V3 checkpoint (`DeepseekV3ForCausalLM`) in Hugging Face layout,
loading in transformers, vLLM and mlx-lm.

DeepSeek-V3 attends through multi-head latent attention (MLA): each token's keys and values are
one compressed row (`kv_lora_rank` wide, RMS-normed) plus a rotary key part (`qk_rope_head_dim`)
shared by every head, and a per-head up-projection (`kv_b_proj`) expands them. Its MoE layers
route with sigmoid scores plus a correction bias, beside shared experts, after
`first_k_dense_replace` dense layers. The tiny model keeps all of that: 3 layers (1 dense, 2 MoE
with top-2 of 4 experts and one shared expert), width 128, 4 heads, a query LoRA of rank 64, a
latent of 64 plus a rotary part of 16 (so 80 values per cached token and layer), nope/value head
dims 32.

The config is transformers' own `DeepseekV3Config` as `save_pretrained` writes it, plus a
top-level `rope_theta`: mlx-lm 0.32.2's `ModelArgs` reads it there (transformers 5 keeps it only
in `rope_parameters`; same value in both), and the published checkpoints' `topk_method` and
`scoring_func`, which vLLM reads. Rotary weights are interleaved, as the published
checkpoints are (`rope_interleave`, mlx-lm's traditional RoPE). Experts are stored one by one, as
hub checkpoints store them. Matrices and the router are drawn from N(0, 0.3) so greedy decoding
does not collapse into one repeated token; RMSNorm weights around 1.
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


def tiny_deepseek_v3_config(
    *,
    dtype: str = "float32",
    num_layers: int = 3,
    first_k_dense_replace: int = 1,
    hidden_size: int = 128,
    num_heads: int = 4,
    q_lora_rank: int | None = 64,
    kv_lora_rank: int = 64,
    qk_rope_head_dim: int = 16,
    qk_nope_head_dim: int = 32,
    v_head_dim: int = 32,
    n_routed_experts: int = 4,
    n_shared_experts: int = 1,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    intermediate_size: int = 64,
    routed_scaling_factor: float = 1.5,
    rope_theta: float = 10000.0,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of the tiny DeepSeek-V3 checkpoint: what `DeepseekV3Config.save_pretrained`
    writes, plus the top-level `rope_theta` mlx-lm reads."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    from transformers import DeepseekV3Config

    config_object = DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        n_shared_experts=n_shared_experts,
        n_routed_experts=n_routed_experts,
        routed_scaling_factor=routed_scaling_factor,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=top_k,
        first_k_dense_replace=first_k_dense_replace,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rope_interleave=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=[token_id(IM_END), token_id(EOT_TOKEN)],
        pad_token_id=token_id(PAD_TOKEN),
        num_mtp_layers=0,
        dtype=dtype,
    )
    config = json.loads(config_object.to_json_string(use_diff=True))
    config["architectures"] = ["DeepseekV3ForCausalLM"]  # save_pretrained takes it from the model
    config["rope_theta"] = rope_theta  # mlx-lm's field; the same value as rope_parameters'
    # The routing the published config.json names (and transformers always applies); vLLM reads
    # these to build the router with its score-correction bias.
    config["topk_method"] = "noaux_tc"
    config["scoring_func"] = "sigmoid"
    return config


def random_weights(
    config: dict[str, Any], seed: int = 0, weight_std: float = 0.3, router_std: float = 0.3
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the checkpoint, experts one by one."""
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    shared = inter * config["n_shared_experts"]

    def normal(*shape: int, std: float = weight_std, mean: float = 0.0) -> np.ndarray:
        return rng.normal(mean, std, size=shape).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return normal(dim, std=0.1, mean=1.0)

    def mlp(prefix: str, rows: int) -> None:
        weights[prefix + "gate_proj.weight"] = normal(rows, hidden)
        weights[prefix + "up_proj.weight"] = normal(rows, hidden)
        weights[prefix + "down_proj.weight"] = normal(hidden, rows)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        a = p + "self_attn."
        if q_rank is None:
            weights[a + "q_proj.weight"] = normal(heads * (nope + rope), hidden)
        else:
            weights[a + "q_a_proj.weight"] = normal(q_rank, hidden)
            weights[a + "q_a_layernorm.weight"] = norm(q_rank)
            weights[a + "q_b_proj.weight"] = normal(heads * (nope + rope), q_rank)
        weights[a + "kv_a_proj_with_mqa.weight"] = normal(kv_rank + rope, hidden)
        weights[a + "kv_a_layernorm.weight"] = norm(kv_rank)
        weights[a + "kv_b_proj.weight"] = normal(heads * (nope + v_dim), kv_rank)
        weights[a + "o_proj.weight"] = normal(hidden, heads * v_dim)
        if i < config["first_k_dense_replace"]:
            mlp(p + "mlp.", config["intermediate_size"])
            continue
        weights[p + "mlp.gate.weight"] = normal(experts, hidden, std=router_std)
        weights[p + "mlp.gate.e_score_correction_bias"] = normal(experts, std=0.05)
        for e in range(experts):
            mlp(p + f"mlp.experts.{e}.", inter)
        mlp(p + "mlp.shared_experts.", shared)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def write_tiny_deepseek_v3(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    router_std: float = 0.3,
    **config_kwargs: Any,
) -> Path:
    """Write the random-weight DeepSeek-V3 checkpoint to ``out_dir`` and return it.

    ``config_kwargs`` (sizes, ``rope_theta``, ...) go to :func:`tiny_deepseek_v3_config`. Files as
    `tiny_models.write_checkpoint` writes them: config, generation config, model.safetensors and
    the tiny tokenizer. The same arguments always give byte-identical files.
    """
    config = tiny_deepseek_v3_config(dtype=dtype, **config_kwargs)
    weights = random_weights(config, seed, weight_std, router_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_deepseek_v3", "DeepSeek-V3", write_tiny_deepseek_v3, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
