"""Tiny random-weight checkpoints in Hugging Face layout for tests that cannot download models.

Each family is a config dict that transformers builds and saves (:func:`write_transformers_checkpoint`);
it loads in transformers, vLLM and mlx-lm, with a trained BPE tokenizer and a ChatML template.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
_TRANSFORMERS_VERSION = importlib.metadata.version("transformers")

# --------------------------------------------------------------------------------------------------
# Architectures
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A model family: its config.json fields beyond the shared tiny sizes, and the parameters
    whose random draw differs from :func:`redraw_weights`' default."""

    config: dict[str, Any]
    # (regex on the parameter name, mean, std): the first match is drawn from N(mean, std).
    init: tuple[tuple[str, float, float], ...] = ()


# Gemma's RMSNorms scale by (1 + weight) and its embeddings are tied: the input token's own
# embedding rides the residual stream into the logits and the model repeats it. A small embedding,
# louder sublayer outputs and sharper q/k norms (stored as scale - 1) keep continuations varied.
_GEMMA_INIT = (
    (r"embed_tokens", 0.0, 0.05),
    (r"post_(attention|feedforward)_layernorm", 7.0, 0.8),
    (r"^model\.norm\.", 3.0, 0.4),
    (r"self_attn\.[qk]_norm", 2.0, 0.3),
)

ARCHS: dict[str, Family] = {
    "llama": Family(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": None,
            "pretraining_tp": 1,
        }
    ),
    "qwen2": Family(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_act": "silu",
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    ),
    "qwen3": Family(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    ),
    # Every layer attends to the last `sliding_window` keys (HF and vLLM honour it; mlx-lm's
    # Mistral, which is its Llama class, ignores it when the config has no `layer_types`).
    "mistral": Family(
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_act": "silu",
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": 32,
        }
    ),
    # Text-only Gemma3: layers alternate sliding (window 32, local RoPE) and global attention.
    "gemma3": Family(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
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
            "tie_word_embeddings": True,
        },
        _GEMMA_INIT,
    ),
    # Hunyuan dense (Hunyuan-7B and its small siblings): per-head q/k norms after RoPE.
    "hunyuan_v1_dense": Family(
        {
            "architectures": ["HunYuanDenseV1ForCausalLM"],
            "model_type": "hunyuan_v1_dense",
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    ),
    # Seed-OSS: biased q/k/v projections, an unbiased output projection.
    "seed_oss": Family(
        {
            "architectures": ["SeedOssForCausalLM"],
            "model_type": "seed_oss",
            "hidden_act": "silu",
            "attention_bias": True,
            "attention_out_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    ),
    # GLM-4 (GLM-4-9B-0414 and its siblings): biased q/k/v, half of each head rotated, norms after
    # each sublayer.
    "glm4": Family(
        {
            "architectures": ["Glm4ForCausalLM"],
            "model_type": "glm4",
            "hidden_act": "silu",
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        }
    ),
    # ERNIE 4.5 dense (0.3B): RoPE on interleaved pairs.
    "ernie4_5": Family(
        {
            "architectures": ["Ernie4_5ForCausalLM"],
            "model_type": "ernie4_5",
            "hidden_act": "silu",
            "use_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        }
    ),
    # Ministral 3 (the language model of Mistral Small 3.2 / Devstral Small 2): YaRN RoPE and
    # Llama 4's position-dependent query scale, both from an original context of 64 tokens (times
    # the factor, 32: the 2048 positions of the tiny models), so the tests' longer sequences cross
    # one of its steps.
    "ministral3": Family(
        {
            "architectures": ["Ministral3ForCausalLM"],
            "model_type": "ministral3",
            "hidden_act": "silu",
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        }
    ),
    "olmo2": Family(
        {
            "architectures": ["Olmo2ForCausalLM"],
            "model_type": "olmo2",
            "hidden_act": "silu",
            "attention_bias": False,
            "rope_theta": 500000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "rope_scaling": None,
        }
    ),
    # OLMo 3: sliding (window 32) and full attention layers, q/k norms over all heads, norms after
    # each sublayer (its layer types: `_layer_types`). No top-level `rope_theta`: as transformers 5
    # saves it, the base (5e5) is only in `rope_parameters`, keyed by layer type.
    "olmo3": Family(
        {
            "architectures": ["Olmo3ForCausalLM"],
            "model_type": "olmo3",
            "hidden_act": "silu",
            "attention_bias": False,
            "sliding_window": 32,
        }
    ),
    # Gemma2: tanh soft-capping of attention logits (50) and final logits (30). Its sliding window
    # (4096) is wider than max_position_embeddings, so it never applies (mlx-lm ignores it anyway).
    "gemma2": Family(
        {
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 64,
            "sliding_window": 4096,
            "rope_theta": 10000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
        _GEMMA_INIT,
    ),
}


def _layer_types(arch: str, config: dict[str, Any], num_layers: int) -> list[str] | None:
    if arch == "gemma3":
        pattern = config["sliding_window_pattern"]
        return [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if arch in ("gemma2", "olmo3"):
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return None


def base_config(dtype: str = "float32", vocab_size: int = TOKENIZER_VOCAB_SIZE) -> dict[str, Any]:
    """The config fields every tiny checkpoint shares: the tiny tokenizer's ids and the dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    return {
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [token_id(IM_END), token_id(EOT_TOKEN)],
        "pad_token_id": token_id(PAD_TOKEN),
        "dtype": dtype,
    }


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
    """The config of a tiny checkpoint of ``arch``: what :func:`write_transformers_checkpoint`
    builds the model from (and a valid config.json by itself)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    if arch == "qwen2" and hidden_size != num_heads * head_dim:
        # mlx-lm's Qwen2 derives head_dim from hidden_size / num_heads.
        raise ValueError("qwen2 needs hidden_size == num_heads * head_dim")
    family = ARCHS[arch].config
    config: dict[str, Any] = {
        **base_config(dtype, vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": dtype,  # transformers 4's name, which hub checkpoints carry beside `dtype`
        **family,
    }
    if arch == "qwen2":
        config["max_window_layers"] = num_layers
    if sliding_window is not None:
        if "sliding_window" not in family or arch in ("qwen2", "qwen3"):
            raise ValueError(f"{arch} has no sliding-window attention here")
        config["sliding_window"] = sliding_window
    if (layer_types := _layer_types(arch, config, num_layers)) is not None:
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
# Weights and files
# --------------------------------------------------------------------------------------------------


def redraw_weights(
    model: Any, seed: int, weight_std: float, init: tuple[tuple[str, float, float], ...] = ()
) -> None:
    """Redraw every parameter of ``model`` in place from ``seed``, whatever torch's global RNG.

    Matrices (embeddings, projections, stacked experts, convolutions) ~ N(0, weight_std): the
    default 0.02 init makes a tiny model repeat one token, which would let any broken kernel pass a
    greedy comparison. Vectors keep transformers' init (norm scales at 1 or 0, decay rates, zero
    biases) plus N(0, 0.1), so a vector loaded in the wrong place shows. ``init`` overrides both.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            rule = next(((m, s) for pattern, m, s in init if re.search(pattern, name)), None)
            if rule is not None:
                param.copy_(noise * rule[1] + rule[0])
            elif param.ndim >= 2:
                param.copy_(noise * weight_std)
            else:
                param.add_(noise * 0.1)


def write_transformers_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    *,
    seed: int = 0,
    weight_std: float = 0.3,
    init: tuple[tuple[str, float, float], ...] = (),
    model_class: str = "AutoModelForCausalLM",
    tokenizer: dict[str, Any] | None = None,
    eos_token_id: Any = None,
) -> Path:
    """Build ``config`` (a config.json dict with its ``model_type``) with transformers, redraw its
    weights (:func:`redraw_weights`) and ``save_pretrained`` it in ``config["dtype"]``.

    config.json is what transformers writes, updated with ``config``: keys transformers drops or
    rewrites (a top-level ``rope_theta``, which mlx-lm reads and hub checkpoints carry) stay as
    given. The generation config and tokenizer files are :func:`write_checkpoint_files`'.
    """
    import torch
    import transformers

    fields = {k: v for k, v in config.items() if k != "model_type"}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # transformers' own init, under the vectors' spread
        model = getattr(transformers, model_class).from_config(hf_config, dtype=torch.float32)
    redraw_weights(model, seed, weight_std, init)
    out = Path(out_dir)
    model.to(getattr(torch, config.get("dtype", "float32"))).save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    saved.update(config)
    return write_checkpoint_files(out, saved, tokenizer=tokenizer, eos_token_id=eos_token_id)


def write_checkpoint_files(
    out_dir: str | Path,
    config: dict[str, Any],
    *,
    tokenizer: dict[str, Any] | None = None,
    eos_token_id: Any = None,
) -> Path:
    """Write the files of a checkpoint beside its weights: config.json, generation_config.json
    (greedy, stopping at ``eos_token_id``, default the config's) and the tokenizer files (the tiny
    tokenizer's unless ``tokenizer`` gives others, file name -> content)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"] if eos_token_id is None else eos_token_id,
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
        "transformers_version": config.get("transformers_version", _TRANSFORMERS_VERSION),
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
    weight_std: float = 0.3,
    **config_kwargs: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` in HF layout to ``out_dir`` and return it.

    ``config_kwargs`` (sizes, ``sliding_window``, ...) go to :func:`tiny_config`. Files:
    config.json, generation_config.json, model.safetensors (weights drawn in float32 from ``seed``,
    saved in ``dtype``), tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json. The same arguments always give byte-identical weights and tokenizer.
    """
    config = tiny_config(arch, dtype=dtype, **config_kwargs)
    return write_transformers_checkpoint(
        out_dir, config, seed=seed, weight_std=weight_std, init=ARCHS[arch].init
    )


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
    # A quantized checkpoint is converted from a float one written beside it.
    written = out if args.quantize_bits is None else out.with_name(out.name + ".src")
    write_tiny_model(
        written,
        args.arch,
        dtype=args.dtype,
        seed=args.seed,
        num_layers=args.num_layers,
        sliding_window=args.sliding_window,
    )
    if args.quantize_bits is not None:
        quantize_tiny_model(written, out, bits=args.quantize_bits, group_size=args.group_size)
        shutil.rmtree(written)
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
