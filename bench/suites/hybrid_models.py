"""The hybrid suite's checkpoints: Qwen3-Next, Qwen3.5 (dense), Granite 4.0-H, DeepSeek-V3,
Gemma 4 (text) and LFM2 at a benchmark size with random weights (the tests' tiny ones with
--quick); `hybrid_describe` says what each is (parameters, state and KV bytes per request)."""

from __future__ import annotations

import functools
import json
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
    # LFM2-350M's layers (hidden 1024; 16 query / 8 KV heads of 64; a convolution window of 3;
    # a feed-forward of 6656 that LFM2 shrinks to 2/3 and rounds up to a multiple of 256: 4608;
    # tied embeddings), its first 8: convolution, convolution, attention, twice, then two
    # convolutions (`full_attn_idxs` 2 and 5), and the suite's vocabulary instead of 65,536.
    "lfm2": {
        "layer_types": ["conv", "conv", "full_attention"] * 2 + ["conv", "conv"],
        "hidden_size": 1024,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_size": 6656,
        "conv_bias": False,
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
    # The tests' tiny LFM2 with the suite's weight spread: with the tests' N(0, 0.3) the plugin and
    # vLLM's CPU backend picked other first tokens for 2 of 16 random prompts (a quick run here).
    "lfm2": {"weight_std": 0.02, "embed_std": 0.02},
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
    "lfm2": {"weight_std": WEIGHT_STD, "embed_std": WEIGHT_STD},
}


# ------------------------------------------------------------------------------ checkpoints


FAMILIES = ("qwen3_next", "qwen3_5", "granite", "deepseek_v3", "gemma4", "lfm2")


def write_hybrid_model(
    work: Path, family: str, quick: bool, seed: int = 0, dtype: str = DTYPE
) -> Path:
    """Write (or reuse) a family's benchmark checkpoint (`--quick`: the tests' tiny one, Granite
    with one group; Qwen3.5 in the text-only `Qwen3_5ForCausalLM` layout; Gemma 4 the E2B-like
    dense `Gemma4ForCausalLM`), its weights in `dtype`."""
    from tests.fixtures.tiny_deepseek_v3 import write_tiny_deepseek_v3
    from tests.fixtures.tiny_gemma4 import write_tiny_gemma4
    from tests.fixtures.tiny_granitemoehybrid import write_tiny_granitemoehybrid
    from tests.fixtures.tiny_lfm2 import write_tiny_lfm2
    from tests.fixtures.tiny_qwen3_5 import write_tiny_qwen3_5
    from tests.fixtures.tiny_qwen3_next import write_tiny_qwen3_next

    writer = {
        "qwen3_next": write_tiny_qwen3_next,
        "qwen3_5": functools.partial(write_tiny_qwen3_5, layout="causal_lm"),
        "granite": write_tiny_granitemoehybrid,
        "deepseek_v3": write_tiny_deepseek_v3,
        "gemma4": functools.partial(write_tiny_gemma4, variant="dense"),
        "lfm2": write_tiny_lfm2,
    }[family]
    name = f"{family}-tiny" if quick else f"{family}-hybrid-random"
    path = Path(work) / "models" / f"{name}-{dtype}"
    if quick:
        kwargs: dict[str, Any] = dict(QUICK_KWARGS[family])
    else:
        kwargs = {**SHAPES[family], **STDS[family]}
    stamp = {"kind": family, "kwargs": kwargs, "dtype": dtype, "seed": seed, "format": 1}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    writer(path, dtype=dtype, seed=seed, **kwargs)
    if not quick:
        from bench.harness.checkpoints import pad_tokenizer

        pad_tokenizer(path / "tokenizer.json", kwargs["vocab_size"])
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path
