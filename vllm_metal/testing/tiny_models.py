"""Tiny random-weight checkpoints in Hugging Face layout for tests that cannot download models.

Each loads in transformers, vLLM and mlx-lm, with a trained BPE tokenizer and a ChatML template.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.tiny_tokenizer import (  # noqa: F401 (part of this module's interface)
    BOS_TOKEN,
    EOT_TOKEN,
    IM_END,
    IM_START,
    MARKUP_TOKENS,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer_json,
    token_id,
    tokenizer_files,
)

DTYPES = ("float32", "float16", "bfloat16")

# --------------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchSpec:
    """How one model family lays out its config and weights."""

    architecture: str
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False  # Qwen2 projections carry biases
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma3)
    # OLMo 2: RMSNorm over the whole q and k projections, and norms on the attention and MLP
    # outputs only (no input norms).
    olmo2_norms: bool = False
    sandwich_norms: bool = False  # Gemma2/3: extra norms around attention and MLP outputs
    offset_norms: bool = False  # Gemma RMSNorm scales by (1 + weight): store weight near 0
    tied: bool = False  # lm_head shares the embedding matrix
    embed_std: float | None = None  # embedding init when it differs from the matrices'
    # Mean scales of some norm weights. With tied embeddings the input token's own embedding rides
    # the residual stream into the logits and the model repeats it; a small embedding, louder
    # sublayer outputs and sharper q/k norms keep Gemma's continuations varied.
    post_norm_scale: float = 1.0  # Gemma's norms on attention / MLP outputs
    final_norm_scale: float = 1.0
    qk_norm_scale: float = 1.0


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        "LlamaForCausalLM",
        "llama",
        {
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": None,
            "pretraining_tp": 1,
        },
    ),
    "qwen2": ArchSpec(
        "Qwen2ForCausalLM",
        "qwen2",
        {
            "hidden_act": "silu",
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
        },
        qkv_bias=True,
    ),
    "qwen3": ArchSpec(
        "Qwen3ForCausalLM",
        "qwen3",
        {
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
        },
        qk_norm=True,
    ),
    # Every layer attends to the last `sliding_window` keys (HF and vLLM honour it; mlx-lm's
    # Mistral, which is its Llama class, ignores it when the config has no `layer_types`).
    "mistral": ArchSpec(
        "MistralForCausalLM",
        "mistral",
        {
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 32,
        },
    ),
    # Text-only Gemma3: layers alternate sliding (window 32, local RoPE) and global attention.
    "gemma3": ArchSpec(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 64,
            "sliding_window": 32,
            "sliding_window_pattern": 2,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": None,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
        },
        qk_norm=True,
        sandwich_norms=True,
        offset_norms=True,
        tied=True,
        embed_std=0.05,
        post_norm_scale=8.0,
        final_norm_scale=4.0,
        qk_norm_scale=3.0,
    ),
    "olmo2": ArchSpec(
        "Olmo2ForCausalLM",
        "olmo2",
        {
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": 500000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "rope_scaling": None,
        },
        olmo2_norms=True,
    ),
    # Gemma2: tanh soft-capping of attention logits (50) and final logits (30). Its sliding window
    # (4096) is wider than max_position_embeddings, so it never applies (mlx-lm ignores it anyway).
    "gemma2": ArchSpec(
        "Gemma2ForCausalLM",
        "gemma2",
        {
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 64,
            "sliding_window": 4096,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "attention_bias": False,
        },
        sandwich_norms=True,
        offset_norms=True,
        tied=True,
        embed_std=0.05,
        post_norm_scale=8.0,
        final_norm_scale=4.0,
    ),
}


def _layer_types(arch: str, spec: ArchSpec, num_layers: int) -> list[str] | None:
    if arch == "gemma3":
        pattern = spec.config["sliding_window_pattern"]
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if arch == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return None


def tiny_config(
    arch: str,
    *,
    dtype: str = "float32",
    num_layers: int = 2,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
) -> dict[str, Any]:
    """The config.json contents for a tiny checkpoint of ``arch``."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    if arch == "qwen2" and hidden_size != num_heads * head_dim:
        # mlx-lm's Qwen2 derives head_dim from hidden_size / num_heads.
        raise ValueError("qwen2 needs hidden_size == num_heads * head_dim")
    spec = ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tied,
        "use_cache": True,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [token_id(IM_END), token_id(EOT_TOKEN)],
        "pad_token_id": token_id(PAD_TOKEN),
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": importlib.metadata.version("transformers"),
    }
    config.update(spec.config)
    if arch == "qwen2":
        config["max_window_layers"] = num_layers
    if sliding_window is not None:
        if "sliding_window" not in spec.config or arch in ("qwen2", "qwen3"):
            raise ValueError(f"{arch} has no sliding-window attention here")
        config["sliding_window"] = sliding_window
    if (layer_types := _layer_types(arch, spec, num_layers)) is not None:
        config["layer_types"] = layer_types
    if arch == "gemma3":
        config["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": config["rope_theta"]},
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": config["rope_local_base_freq"],
            },
        }
    return config


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


def _random_weights(
    spec: ArchSpec, config: dict[str, Any], seed: int, weight_std: float
) -> dict[str, np.ndarray]:
    """HF-named float32 tensors. Matrices ~ N(0, weight_std): the default 0.02 init makes a tiny
    model repeat one token, which would let any broken kernel pass a greedy comparison."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    vocab = config["vocab_size"]

    def matrix(rows: int, cols: int, std: float = weight_std) -> np.ndarray:
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    def norm(dim: int, scale: float = 1.0) -> np.ndarray:
        # Spread around the mean scale, so a norm weight loaded in the wrong place shows.
        effective = scale * (1.0 + rng.normal(0.0, 0.1, size=(dim,)))
        return (effective - 1.0 if spec.offset_norms else effective).astype(np.float32)

    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": matrix(vocab, hidden, spec.embed_std or weight_std)
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if not spec.olmo2_norms:
            weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = matrix(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = matrix(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = matrix(hidden, q_dim)
        if spec.qkv_bias:
            for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                weights[p + f"self_attn.{name}_proj.bias"] = rng.normal(
                    0.0, weight_std, size=(dim,)
                ).astype(np.float32)
        if spec.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = norm(head_dim, spec.qk_norm_scale)
            weights[p + "self_attn.k_norm.weight"] = norm(head_dim, spec.qk_norm_scale)
        if spec.olmo2_norms:
            weights[p + "self_attn.q_norm.weight"] = norm(q_dim)
            weights[p + "self_attn.k_norm.weight"] = norm(kv_dim)
            weights[p + "post_attention_layernorm.weight"] = norm(hidden)
            weights[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        elif spec.sandwich_norms:
            # Gemma: post_attention_layernorm normalises the attention output, and the MLP input
            # gets its own pre_feedforward_layernorm.
            weights[p + "post_attention_layernorm.weight"] = norm(hidden, spec.post_norm_scale)
            weights[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            weights[p + "post_feedforward_layernorm.weight"] = norm(hidden, spec.post_norm_scale)
        else:
            weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
    weights["model.norm.weight"] = norm(hidden, spec.final_norm_scale)
    if not spec.tied:
        weights["lm_head.weight"] = matrix(vocab, hidden)
    return weights


def save_safetensors(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Floating tensors in ``dtype``; integer ones (packed quantized blocks, scales) as they are."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name, value in weights.items():
        tensor = torch.from_numpy(np.ascontiguousarray(value))
        floating = np.issubdtype(value.dtype, np.floating)
        tensors[name] = (tensor.to(torch_dtype) if floating else tensor).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    weights: dict[str, np.ndarray],
    dtype: str,
    *,
    tokenizer: dict[str, Any] | None = None,
    eos_token_id: Any = None,
) -> Path:
    """Write a checkpoint in HF layout: config.json, generation_config.json (greedy, stopping at
    ``eos_token_id``, default the config's), model.safetensors and the tokenizer files (the tiny
    tokenizer's unless ``tokenizer`` gives others, file name -> content)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, out / "model.safetensors", dtype)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"] if eos_token_id is None else eos_token_id,
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
        "transformers_version": config["transformers_version"],
    }
    files: dict[str, Any] = {
        "config.json": config,
        "generation_config.json": generation_config,
        **(tokenizer if tokenizer is not None else tokenizer_files(build_tokenizer_json())),
    }
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
        (out / name).write_text(text, encoding="utf-8")
    return out


def write_tiny_model(
    out_dir: str | Path,
    arch: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    weight_std: float = 0.3,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` in HF layout to ``out_dir`` and return it.

    Files: config.json, generation_config.json, model.safetensors (``dtype`` weights drawn in
    float32 from ``seed``), tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json. The same arguments always give byte-identical weights and tokenizer.
    """
    config = tiny_config(
        arch,
        dtype=dtype,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        sliding_window=sliding_window,
    )
    weights = _random_weights(ARCHS[arch], config, seed, weight_std)
    return write_checkpoint(out_dir, config, weights, dtype)


def quantize_tiny_model(
    src: str | Path, dst: str | Path, *, bits: int = 4, group_size: int = 64
) -> Path:
    """Quantize checkpoint ``src`` with mlx-lm's own converter into ``dst`` (affine, MLX layout).

    The result is what ``mlx_lm.convert --quantize`` publishes: packed uint32 weights with
    per-group scales and biases, and a ``quantization`` entry in config.json.
    """
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"bits must be one of 2, 3, 4, 5, 6, 8, not {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, not {group_size}")
    from mlx_lm.convert import convert

    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(src), str(dst), quantize=True, q_bits=bits, q_group_size=group_size)
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_models",
        description="Write a tiny random-weight checkpoint and print its path.",
    )
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--sliding-window", type=int, default=None)
    parser.add_argument("--quantize-bits", type=int, default=None, help="also MLX-quantize")
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args(argv)

    out = Path(args.out)
    if args.quantize_bits is None:
        write_tiny_model(
            out,
            args.arch,
            dtype=args.dtype,
            seed=args.seed,
            num_layers=args.num_layers,
            sliding_window=args.sliding_window,
        )
    else:
        staging = out.with_name(out.name + ".src")
        write_tiny_model(
            staging,
            args.arch,
            dtype=args.dtype,
            seed=args.seed,
            num_layers=args.num_layers,
            sliding_window=args.sliding_window,
        )
        quantize_tiny_model(staging, out, bits=args.quantize_bits, group_size=args.group_size)
        shutil.rmtree(staging)
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
