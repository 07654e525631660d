"""Tiny GGUF files for tests: a tiny Hugging Face checkpoint (`tiny_models.write_tiny_model`)
rewritten the way llama.cpp's converter lays it out, in one tensor type.

Names come from the `gguf` package's tensor-name maps; Llama/Mistral q/k rows get llama.cpp's
rotary permutation and Gemma norms its `+1`; 1-D tensors stay F32 as llama.cpp keeps them. Floats and
Q8_0/Q4_0/Q4_1 are encoded by `gguf.quants.quantize`. The `gguf` package cannot quantize K-quants
(0.19.0 only decodes them), so Q4_K/Q5_K/Q6_K are encoded here, with a plain per-sub-block min/max
fit rather than llama.cpp's search; decoding stays the package's (`gguf.quants.dequantize`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> GGUF general.architecture (llama.cpp writes Mistral as "llama").
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def _permute_rows(weights: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): interleaved to half-split rotary
    rows, per head, on q (n_head, n_head) and k (n_head, n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


# --------------------------------------------------------------------------------------------------
# K-quant encoders (block layouts of ggml-common.h; the decoders are gguf.quants')
# --------------------------------------------------------------------------------------------------

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _scale_min_k4(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-element sub-block affine fit `w = d*sc*q - dmin*m` with 6-bit sc and m (Q4_K/Q5_K)."""
    sub = blocks.reshape(len(blocks), 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # the offset is subtracted: the minimum must be <= 0
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(-lo.min(axis=-1) / 63)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dminf > 0, np.rint(-lo / dminf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.rint((sub + (dminf * m)[..., None]) / step), 0)
    q = q.clip(0, levels).astype(np.uint8)
    # 12 bytes: low 6 bits of sc[0:4] and m[0:4], their top 2 bits carrying sc[4:8] / m[4:8] >> 4,
    # then the low nibbles of sc[4:8] | m[4:8] << 4 (gguf.quants.Q4_K.get_scale_min, inverted).
    packed = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    return d, dmin, packed, q.reshape(len(blocks), QK_K)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 256] values < 16 -> [n, 128] bytes: sub-block 2i in the low nibbles of bytes
    32i..32i+31, sub-block 2i+1 in their high nibbles."""
    q = q.reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128).astype(np.uint8)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _scale_min_k4(blocks, 15)
    return np.concatenate(
        [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, _nibbles(q)], axis=-1
    )


def _quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _scale_min_k4(blocks, 31)
    # qh: bit i of byte l is the fifth bit of element l of sub-block i.
    high = (q >> 4).reshape(len(q), 8, 32)
    qh = np.zeros((len(q), 32), dtype=np.uint8)
    for i in range(8):
        qh |= (high[:, i] << i).astype(np.uint8)
    return np.concatenate(
        [d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), scales, qh, _nibbles(q & 0x0F)],
        axis=-1,
    )


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(scale.max(axis=-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        step = (df * sc)[..., None]
        q = np.where(step != 0, np.rint(sub / step), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half, group, element]
    low, high = q & 0x0F, q >> 4
    # ql: half h, group r: bytes 64h + 32(r%2) + l, nibble r//2; qh: bytes 32h + l, bits 2r.
    ql = np.zeros((n, 2, 2, 32), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for r in range(4):
        ql[:, :, r % 2] |= (low[:, :, r] << (4 * (r // 2))).astype(np.uint8)
        qh |= (high[:, :, r] << (2 * r)).astype(np.uint8)
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d[:, None].view(np.uint8)],
        axis=-1,
    )


_K_ENCODERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """`weights` [rows, cols] float32 -> the tensor's bytes [rows, row_bytes] in GGUF type
    `type_name` (float types: the values in that dtype)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    if type_name in _K_ENCODERS:
        rows, cols = weights.shape
        if cols % QK_K:
            raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} values, not {cols}")
        blocks = _K_ENCODERS[type_name](weights.reshape(-1, QK_K))
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(weights, qtype)


# --------------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------------


def _tokenizer_metadata(writer: Any, model_dir: Path, config: dict[str, Any]) -> None:
    """The tiny byte-level BPE as llama.cpp's "gpt2" tokenizer model (vocab, merges, specials)."""
    import gguf

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {t["content"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    tokens = [""] * config["vocab_size"]
    types = [gguf.TokenType.UNUSED] * config["vocab_size"]
    for text, idx in vocab.items():
        tokens[idx] = text
        types[idx] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    for idx, text in enumerate(tokens):
        if not text:
            tokens[idx] = f"[PAD{idx}]"
    merges = tokenizer["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    eos = config["eos_token_id"]
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    writer.add_pad_token_id(config["pad_token_id"])
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if tokenizer_config.get("chat_template"):
        writer.add_chat_template(tokenizer_config["chat_template"])


def write_tiny_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    type_name: str = "F16",
    *,
    overrides: dict[str, str] | None = None,
    tokenizer: bool = True,
) -> Path:
    """Write the checkpoint in ``model_dir`` (config.json + model.safetensors) as a GGUF file.

    Every 2-D tensor is stored as ``type_name``, 1-D ones (norms, biases) as F32; ``overrides``
    maps GGUF tensor names (``"output.weight"``) to another type. ``tokenizer`` adds the tiny
    tokenizer's vocabulary and merges (llama.cpp's "gpt2" tokenizer model).
    """
    import gguf
    from safetensors.numpy import load_file

    if type_name not in TYPES:
        raise ValueError(f"unknown GGUF type {type_name!r}; choose from {TYPES}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    model_type = config["model_type"]
    if model_type not in GGUF_ARCH:
        raise ValueError(f"no GGUF layout for model_type {model_type!r}")
    arch_name = GGUF_ARCH[model_type]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name)
    n_layers = config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch, n_layers)
    weights = {
        k: v.astype(np.float32) for k, v in load_file(model_dir / "model.safetensors").items()
    }

    writer = gguf.GGUFWriter(str(out_path), arch_name)
    # transformers reads a llama-architecture file as Mistral when general.name says so.
    writer.add_name(f"tiny {model_type}")
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch_name == "llama":
        writer.add_rope_dimension_count(config["head_dim"])
    if config.get("sliding_window") and arch_name in ("llama", "gemma2", "gemma3"):
        writer.add_sliding_window(config["sliding_window"])
    if config.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    file_types = {
        "F32": "ALL_F32",
        "F16": "MOSTLY_F16",
        "BF16": "MOSTLY_BF16",
        "Q4_K": "MOSTLY_Q4_K_M",
        "Q5_K": "MOSTLY_Q5_K_M",
    }
    file_type = file_types.get(type_name, f"MOSTLY_{type_name}")
    writer.add_file_type(int(gguf.LlamaFileType[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if tokenizer:
        _tokenizer_metadata(writer, model_dir, config)

    overrides = dict(overrides or {})
    for hf_name, value in weights.items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_base = name_map.get_name(base)
        if gguf_base is None:
            raise ValueError(f"{hf_name}: no GGUF name for {arch_name}")
        name = f"{gguf_base}.{suffix}"
        if arch_name == "llama" and base.endswith(("q_proj", "k_proj")):
            n_kv = config[
                "num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"
            ]
            value = _permute_rows(value, config["num_attention_heads"], n_kv)
        if arch_name in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp stores Gemma's (1 + weight) scale
        kind = overrides.pop(name, "F32" if value.ndim == 1 else type_name)
        raw = quantize(value, kind)
        raw_dtype = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, raw, raw_dtype=raw_dtype)
    if overrides:
        raise ValueError(f"overrides name tensors the file does not have: {sorted(overrides)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_gguf",
        description="Write a tiny checkpoint as a GGUF file and print its path.",
    )
    parser.add_argument("--model-dir", required=True, help="a tiny HF checkpoint (tiny_models)")
    parser.add_argument("--type", default="F16", choices=TYPES)
    parser.add_argument("--out", required=True, help="output .gguf path")
    args = parser.parse_args(argv)
    print(write_tiny_gguf(args.model_dir, args.out, args.type).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
