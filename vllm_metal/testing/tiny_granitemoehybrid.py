"""A tiny random-weight Granite 4.0-H checkpoint (`GraniteMoeHybridForCausalLM`) in Hugging Face
layout, loading in transformers, vLLM and mlx-lm.

Granite 4.0-H is a hybrid: Mamba-2 layers with an occasional attention layer, each layer followed
by a top-k MoE block plus an always-on shared MLP. The tiny model keeps that: 4 layers ("mamba",
"attention", "mamba", "mamba"), width 128, attention with 2 query heads and 1 KV head of 64 (the
head size is hidden / heads; RoPE, theta 10000), Mamba-2 with 4 heads of 32 (intermediate 128,
so `mamba_expand` 1), state 32, 2 groups of B/C, a conv window of 4 with bias; top-2 of 4 experts.

The muP multipliers are all set away from 1 so that a reader dropping one shows in the logits:
inputs scaled by `embedding_multiplier` 12, attention scores by `attention_multiplier` 1/64 (as
Granite does: 1 / head_dim, not the default 1 / sqrt(head_dim)), sublayer outputs by
`residual_multiplier` 0.5, logits divided by `logits_scaling` 2. Embeddings are tied, as in the
released models.

The config is transformers' own `GraniteMoeHybridConfig`, with two changes to what it would save:
`layer_types` keeps the hub names "mamba" / "attention" (transformers 5 rewrites them to
"linear_attention" / "full_attention" on load, and vLLM reads the rewritten config; mlx-lm accepts
only the hub names), and `time_step_limit` is left out, as on the hub (transformers encodes its
infinite bound as a non-JSON object). mlx-lm then clamps dt to its default [0.001, 100] while
transformers and vLLM clamp to [0, inf); the weights keep every dt inside both (see below).
`rope_parameters` carries theta; mlx-lm 0.32.2 reads it from there too.

Groups: transformers 5.19 and mlx-lm 0.32.2 apply the gated RMSNorm after the scan over the whole
Mamba intermediate, while vLLM's `Mixer2RMSNormGated` (like mamba_ssm) normalises each group's
slice separately. With 2 groups vLLM's logits therefore differ from the other two (by about 2, and
greedy continuations part after a few tokens); the released models have one group, where all three
agree (pass ``mamba_n_groups=1`` for that).

Weights are stored as hub checkpoints store them: experts stacked in `block_sparse_moe.input_linear`
(gate rows, then up rows) and `output_linear`, the router in `router.layer`, the conv kernel as
(channels, 1, window). Norm weights are scales around 1, `D` is around 1, `A_log` the log of a decay
rate in [1, 16] (as transformers initialises it). `dt_bias` is Mamba-2's initialisation, the
inverse softplus of a time step log-uniform in [0.01, 0.1], and the dt rows of `in_proj` are drawn
small, so dt stays within about [0.005, 0.2]: the state remembers a token for tens of steps
(with `dt_bias` near 1 it forgot it within ~10). Other matrices are drawn from N(0, 0.3), the
embedding from N(0, 0.1): 12x that after the multiplier is still small next to the sublayer outputs,
so greedy decoding of the tied model does not echo its input token (with 0.3 it repeats tokens).
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


def tiny_granitemoehybrid_config(
    *,
    dtype: str = "float32",
    layer_types: Sequence[str] = ("mamba", "attention", "mamba", "mamba"),
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    mamba_n_heads: int = 4,
    mamba_d_head: int = 32,
    mamba_d_state: int = 32,
    mamba_n_groups: int = 2,
    mamba_d_conv: int = 4,
    num_experts: int = 4,
    top_k: int = 2,
    intermediate_size: int = 64,
    shared_intermediate_size: int = 64,
    embedding_multiplier: float = 12.0,
    attention_multiplier: float = 1 / 64,
    residual_multiplier: float = 0.5,
    logits_scaling: float = 2.0,
    tie_word_embeddings: bool = True,
    rope_theta: float = 10000.0,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
) -> dict[str, Any]:
    """config.json of the tiny Granite 4.0-H checkpoint: what `GraniteMoeHybridConfig` writes,
    with the hub's layer type names and no `time_step_limit`."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    mamba_intermediate = mamba_n_heads * mamba_d_head
    if mamba_intermediate % hidden_size:
        raise ValueError("mamba_n_heads * mamba_d_head must be a multiple of hidden_size")
    from transformers import GraniteMoeHybridConfig

    config_object = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        position_embedding_type="rope",
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        mamba_n_heads=mamba_n_heads,
        mamba_d_head=mamba_d_head,
        mamba_expand=mamba_intermediate // hidden_size,
        mamba_d_state=mamba_d_state,
        mamba_n_groups=mamba_n_groups,
        mamba_d_conv=mamba_d_conv,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=intermediate_size,
        shared_intermediate_size=shared_intermediate_size,
        embedding_multiplier=embedding_multiplier,
        attention_multiplier=attention_multiplier,
        residual_multiplier=residual_multiplier,
        logits_scaling=logits_scaling,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=token_id(BOS_TOKEN),
        eos_token_id=[token_id(IM_END), token_id(EOT_TOKEN)],
        pad_token_id=token_id(PAD_TOKEN),
        dtype=dtype,
    )
    config = json.loads(config_object.to_json_string(use_diff=True))
    config["architectures"] = ["GraniteMoeHybridForCausalLM"]  # save_pretrained adds it
    config["layer_types"] = list(layer_types)  # hub names; transformers saves its renamed ones
    config.pop("time_step_limit", None)  # [0, {"__float__": "Infinity"}] breaks mlx-lm
    return config


def random_weights(
    config: dict[str, Any], seed: int = 0, weight_std: float = 0.3, embed_std: float = 0.1
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of the checkpoint, experts stacked."""
    rng = np.random.default_rng(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    m_heads, inner = config["mamba_n_heads"], config["mamba_n_heads"] * config["mamba_d_head"]
    conv_dim = inner + 2 * config["mamba_n_groups"] * config["mamba_d_state"]
    experts, inter = config["num_local_experts"], config["intermediate_size"]
    shared = config["shared_intermediate_size"]

    def normal(*shape: int, std: float = weight_std, mean: float = 0.0) -> np.ndarray:
        return rng.normal(mean, std, size=shape).astype(np.float32)

    def scale(dim: int) -> np.ndarray:  # RMSNorm weights multiply
        return normal(dim, std=0.1, mean=1.0)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=embed_std)}
    for i, layer_type in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = scale(hidden)
        weights[p + "post_attention_layernorm.weight"] = scale(hidden)
        if layer_type == "mamba":
            m = p + "mamba."
            # rows: gate (inner), conv input x|B|C (conv_dim), dt (heads); dt kept near dt_bias
            dt_rows = normal(m_heads, hidden, std=weight_std / 10)
            weights[m + "in_proj.weight"] = np.concatenate(
                [normal(inner + conv_dim, hidden), dt_rows]
            )
            weights[m + "conv1d.weight"] = normal(conv_dim, 1, config["mamba_d_conv"], std=0.5)
            weights[m + "conv1d.bias"] = normal(conv_dim, std=0.1)
            weights[m + "A_log"] = np.log(rng.uniform(1.0, 16.0, m_heads)).astype(np.float32)
            dt = np.exp(rng.uniform(np.log(0.01), np.log(0.1), m_heads))  # Mamba-2's init
            weights[m + "dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
            weights[m + "D"] = normal(m_heads, std=0.1, mean=1.0)
            weights[m + "norm.weight"] = scale(inner)
            weights[m + "out_proj.weight"] = normal(hidden, inner)
        else:
            a = p + "self_attn."
            weights[a + "q_proj.weight"] = normal(heads * head_dim, hidden)
            weights[a + "k_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "v_proj.weight"] = normal(kv_heads * head_dim, hidden)
            weights[a + "o_proj.weight"] = normal(hidden, heads * head_dim)
        moe = p + "block_sparse_moe."
        weights[moe + "router.layer.weight"] = normal(experts, hidden)
        weights[moe + "input_linear.weight"] = normal(experts, 2 * inter, hidden)  # gate, up
        weights[moe + "output_linear.weight"] = normal(experts, hidden, inter)
        weights[p + "shared_mlp.input_linear.weight"] = normal(2 * shared, hidden)
        weights[p + "shared_mlp.output_linear.weight"] = normal(hidden, shared)
    weights["model.norm.weight"] = scale(hidden)
    if not config.get("tie_word_embeddings"):
        weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def write_tiny_granitemoehybrid(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    embed_std: float = 0.1,
    **config_kwargs: Any,
) -> Path:
    """Write the random-weight Granite 4.0-H checkpoint to ``out_dir`` and return it.

    ``config_kwargs`` (sizes, multipliers, ``mamba_n_groups``, ...) go to
    :func:`tiny_granitemoehybrid_config`. Files as `tiny_models.write_checkpoint` writes them:
    config, generation config, model.safetensors and the tiny tokenizer. The same arguments always
    give byte-identical files.
    """
    config = tiny_granitemoehybrid_config(dtype=dtype, **config_kwargs)
    weights = random_weights(config, seed, weight_std, embed_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv,
        "vllm_metal.testing.tiny_granitemoehybrid",
        "Granite 4.0-H",
        write_tiny_granitemoehybrid,
        DTYPES,
    )


if __name__ == "__main__":
    sys.exit(main())
