"""A tiny random-weight LFM2 checkpoint (`Lfm2ForCausalLM`, Liquid's hybrid) in Hugging Face layout,
loading in transformers and vLLM.

LFM2 interleaves gated short-convolution layers with attention layers; every layer is followed by a
SwiGLU feed-forward block. A convolution layer projects its input to ``B``, ``C`` and ``x``
(`conv.in_proj`), convolves ``B * x`` causally over the last `conv_L_cache` tokens, channel by
channel (`conv.conv`, stored ``(channels, 1, L)``), gates the result by ``C`` and projects it back
(`conv.out_proj`). Attention has per-head RMSNorms on q and k (`q_layernorm`, `k_layernorm`) and
RoPE. The tiny model keeps that: 4 layers ("conv", "full_attention", "conv", "conv"), width 256,
4 query heads and 2 KV heads of 64 (vLLM derives the head size as hidden / heads), a window of 3
with biases on the convolution's projections and kernel (the released models have none:
``conv_bias=False``), feed-forward 512 wide (`intermediate_size` 768 shrunk by LFM2's
`block_auto_adjust_ff_dim` to 2/3 and rounded up to `block_multiple_of` 256, which transformers
only does with a `block_ffn_dim_multiplier`, so it is set to 1.0 as in the released configs).
Embeddings are tied, as in the released models.

The config is transformers' `Lfm2Config` with the fields vLLM's `Lfm2ForCausalLM` reads besides
it, as the hub's config.json has them: `conv_dim` and `block_dim` (both the hidden size),
`full_attn_idxs` beside `layer_types`, and `rope_theta` out of `rope_parameters`.

Weights: matrices ~ N(0, 0.3), the convolution kernel ~ N(0, 0.5), norm scales around 1, the
embedding ~ N(0, 0.05): the tied model's input token rides the residual stream into the logits, and a
wider embedding makes greedy decoding repeat its input.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
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

LAYER_TYPES = ("conv", "full_attention", "conv", "conv")


def tiny_lfm2_config(
    *,
    dtype: str = "float32",
    layer_types: Sequence[str] = LAYER_TYPES,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 768,
    conv_L_cache: int = 3,
    conv_bias: bool = True,
    rope_theta: float = 10000.0,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of the tiny LFM2 checkpoint: what `Lfm2Config` writes, plus the hub's
    `conv_dim`, `block_dim`, `full_attn_idxs` and `rope_theta`."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    unknown = set(layer_types) - {"conv", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types must be 'conv' or 'full_attention', got {sorted(unknown)}")
    if hidden_size % num_heads:
        raise ValueError("hidden_size must be a multiple of num_heads (head size = hidden / heads)")
    from transformers import Lfm2Config

    config_object = Lfm2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        norm_eps=1e-5,
        layer_types=list(layer_types),
        conv_bias=conv_bias,
        conv_L_cache=conv_L_cache,
        block_multiple_of=256,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=True,
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=[token_id(IM_END), token_id(EOT_TOKEN)],
        pad_token_id=token_id(PAD_TOKEN),
        dtype=dtype,
    )
    config = json.loads(config_object.to_json_string(use_diff=True))
    config["architectures"] = ["Lfm2ForCausalLM"]  # save_pretrained adds it
    config["full_attn_idxs"] = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    config["conv_dim"] = hidden_size
    config["block_dim"] = hidden_size
    config["rope_theta"] = rope_theta
    return config


def feed_forward_size(config: dict[str, Any]) -> int:
    """Width of the SwiGLU block as LFM2 derives it from `intermediate_size`."""
    size = config["intermediate_size"]
    if config.get("block_auto_adjust_ff_dim"):
        size = int(2 * size / 3)
        multiplier = config.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            size = int(multiplier * size)
            step = config["block_multiple_of"]
            size = step * ((size + step - 1) // step)
    return size


def random_weights(
    config: dict[str, Any], seed: int = 0, weight_std: float = 0.3, embed_std: float = 0.05
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the checkpoint."""
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    ffn = feed_forward_size(config)
    bias = bool(config.get("conv_bias"))

    def normal(*shape: int, std: float = weight_std, mean: float = 0.0) -> np.ndarray:
        return rng.normal(mean, std, size=shape).astype(np.float32)

    def scale(dim: int) -> np.ndarray:  # RMSNorm weights multiply
        return normal(dim, std=0.1, mean=1.0)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=embed_std)}
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        weights[p + "operator_norm.weight"] = scale(hidden)
        weights[p + "ffn_norm.weight"] = scale(hidden)
        if layer_type == "conv":
            c = p + "conv."
            weights[c + "in_proj.weight"] = normal(3 * hidden, hidden)  # B, C, x rows
            weights[c + "conv.weight"] = normal(hidden, 1, config["conv_L_cache"], std=0.5)
            weights[c + "out_proj.weight"] = normal(hidden, hidden)
            if bias:
                weights[c + "in_proj.bias"] = normal(3 * hidden, std=0.1)
                weights[c + "conv.bias"] = normal(hidden, std=0.1)
                weights[c + "out_proj.bias"] = normal(hidden, std=0.1)
        else:
            a = p + "self_attn."
            weights[a + "q_proj.weight"] = normal(heads * head_dim, hidden)
            weights[a + "k_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "v_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "out_proj.weight"] = normal(hidden, heads * head_dim)
            weights[a + "q_layernorm.weight"] = scale(head_dim)
            weights[a + "k_layernorm.weight"] = scale(head_dim)
        f = p + "feed_forward."
        weights[f + "w1.weight"] = normal(ffn, hidden)  # gate
        weights[f + "w3.weight"] = normal(ffn, hidden)  # up
        weights[f + "w2.weight"] = normal(hidden, ffn)
    weights["model.embedding_norm.weight"] = scale(hidden)
    return weights


def write_tiny_lfm2(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    embed_std: float = 0.05,
    **config_kwargs: Any,
) -> Path:
    """Write the random-weight LFM2 checkpoint to ``out_dir`` and return it.

    ``config_kwargs`` (sizes, ``layer_types``, ``conv_bias``, ...) go to
    :func:`tiny_lfm2_config`. Files as `tiny_models.write_checkpoint` writes them: config,
    generation config, model.safetensors and the tiny tokenizer. The same arguments always give
    byte-identical files.
    """
    config = tiny_lfm2_config(dtype=dtype, **config_kwargs)
    weights = random_weights(config, seed, weight_std, embed_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_lfm2", "LFM2", write_tiny_lfm2, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
