"""The benchmark checkpoints: a random-weight model with Qwen3-0.6B's shapes, or a tiny one.

No model hub is needed. Weights are random (the decode cost does not depend on their values); the
tokenizer is the project's tiny BPE tokenizer padded to the model's vocabulary size.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.tiny_models import tiny_config, write_tiny_model


@dataclass(frozen=True)
class ModelShape:
    """Transformer shape of a Qwen3-family benchmark checkpoint."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    weight_std: float = 0.02  # of every matrix; norms are ones


SHAPES: dict[str, ModelShape] = {
    # Qwen/Qwen3-0.6B's config.json: 28 layers, GQA 16/8, head_dim 128, tied 151936-row embedding.
    # The usual 0.02 init keeps activations finite through 28 layers in bf16; greedy decoding then
    # repeats one token for several steps at a time (transformers float32).
    "0.6b": ModelShape("qwen3-0.6b-random", 28, 1024, 3072, 16, 8, 128, 151936, True),
    # 8 layers of Qwen3-0.6B's width with head_dim 64 (vLLM's CPU backend takes 64, not 16 or 32)
    # and an untied 32,000-row vocabulary: 166 M parameters. With N(0, 0.1) weights greedy
    # continuations are diverse (20+ distinct tokens in 24) and the top two logits rarely within
    # 0.01, so engines' tokens can be compared.
    "0.17b": ModelShape("qwen3-0.17b-random", 8, 1024, 3072, 16, 8, 64, 32000, False, 0.1),
    # Qwen3-0.6B's depth and vocabulary at a width of 64 (2 query / 1 KV heads of 64): per-op and
    # per-step costs dominate a step, as on a GPU, even on MLX's CPU device.
    "0.6b-narrow": ModelShape("qwen3-0.6b-narrow", 28, 64, 192, 2, 1, 64, 151936, True, 0.1),
    # The test suite's tiny Qwen3 (a few MB): for checking the harness, not for speed claims.
    "tiny": ModelShape("qwen3-tiny-random", 2, 256, 512, 4, 2, 64, 768, False, 0.3),
}

_STAMP = "bench_model.json"  # what was written, so a cached checkpoint is reused only if it matches


def write_model(out_dir: Path, size: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write (or reuse) the ``size`` checkpoint in ``dtype`` under ``out_dir`` and return its path."""
    shape = SHAPES[size]
    path = Path(out_dir) / f"{shape.name}-{dtype}"
    stamp = {"shape": asdict(shape), "dtype": dtype, "seed": seed, "format": 2}
    if (path / _STAMP).is_file() and json.loads((path / _STAMP).read_text()) == stamp:
        return path
    # The tiny writer supplies the tokenizer files, generation config and chat template.
    write_tiny_model(path, "qwen3", dtype=dtype, seed=seed, weight_std=shape.weight_std)
    if size != "tiny":
        _write_shape(path, shape, dtype, seed)
    (path / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def _write_shape(path: Path, shape: ModelShape, dtype: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = tiny_config(
        "qwen3",
        dtype=dtype,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_position_embeddings=40960,
    )
    config["tie_word_embeddings"] = shape.tied
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    rng = np.random.default_rng(seed)
    torch_dtype = getattr(torch, dtype)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        a = rng.standard_normal((rows, cols), dtype=np.float32)
        a *= shape.weight_std
        return torch.from_numpy(a).to(torch_dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch_dtype)

    h, d = shape.hidden_size, shape.head_dim
    q_dim, kv_dim = shape.num_heads * d, shape.num_kv_heads * d
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": matrix(shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = ones(h)
        tensors[p + "post_attention_layernorm.weight"] = ones(h)
        tensors[p + "self_attn.q_proj.weight"] = matrix(q_dim, h)
        tensors[p + "self_attn.k_proj.weight"] = matrix(kv_dim, h)
        tensors[p + "self_attn.v_proj.weight"] = matrix(kv_dim, h)
        tensors[p + "self_attn.o_proj.weight"] = matrix(h, q_dim)
        tensors[p + "self_attn.q_norm.weight"] = ones(d)
        tensors[p + "self_attn.k_norm.weight"] = ones(d)
        tensors[p + "mlp.gate_proj.weight"] = matrix(shape.intermediate_size, h)
        tensors[p + "mlp.up_proj.weight"] = matrix(shape.intermediate_size, h)
        tensors[p + "mlp.down_proj.weight"] = matrix(h, shape.intermediate_size)
    tensors["model.norm.weight"] = ones(h)
    if not shape.tied:
        tensors["lm_head.weight"] = matrix(shape.vocab_size, h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    pad_tokenizer(path / "tokenizer.json", shape.vocab_size)


def pad_tokenizer(tokenizer_path: Path, vocab_size: int) -> None:
    """Give every model token id a vocabulary entry, so sampled ids always detokenize.

    The padding entries are strings of byte-level characters that no BPE merge produces, so the
    encoding of any text is unchanged.
    """
    from tokenizers import pre_tokenizers

    data = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    # tokenizers numbers added tokens after the model vocabulary unless the vocabulary already
    # holds them: enter them at their ids, so they keep those ids once the vocabulary grows.
    for t in data["added_tokens"]:
        vocab.setdefault(t["content"], t["id"])
    used_ids = set(vocab.values())
    taken = set(vocab)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    free_ids = (i for i in range(vocab_size) if i not in used_ids)
    n = len(alphabet)
    k = 0
    for token_id in free_ids:
        while True:
            text = alphabet[k // (n * n)] + alphabet[(k // n) % n] + alphabet[k % n]
            k += 1
            if text not in taken:
                break
        vocab[text] = token_id
    tokenizer_path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _derived(source: Path, out_dir: Path, stamp: dict[str, Any], own: tuple[str, ...]) -> bool:
    """Whether ``out_dir`` already holds the checkpoint ``stamp`` describes; if not, prepare it
    with every file of ``source`` but the stamp and the files in ``own``."""
    import shutil

    source_stamp = Path(source) / _STAMP
    stamp = {**stamp, "source": str(source)}
    stamp["source_stamp"] = source_stamp.read_text() if source_stamp.is_file() else None
    if (out_dir / _STAMP).is_file() and json.loads((out_dir / _STAMP).read_text()) == stamp:
        return True
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():
        if f.name not in (*own, _STAMP):
            shutil.copy(f, out_dir / f.name)
    (out_dir / f"{_STAMP}.pending").write_text(json.dumps(stamp, indent=2) + "\n")
    return False


def _finish(out_dir: Path) -> Path:
    (out_dir / f"{_STAMP}.pending").replace(out_dir / _STAMP)
    return out_dir


def write_layer_subset(target: Path, out_dir: Path, num_layers: int) -> Path:
    """Write (or reuse) a draft checkpoint: the target's first ``num_layers`` decoder layers, with
    its embeddings, final norm, head and tokenizer (a "layer-skip" draft of the same weights)."""
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    own = ("model.safetensors", "config.json")
    if _derived(target, out_dir, {"num_layers": num_layers}, own):
        return out_dir
    config = json.loads((Path(target) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    keep = {
        name: array
        for name, array in load_file(str(Path(target) / "model.safetensors")).items()
        if not (name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers)
    }
    save_file(keep, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return _finish(out_dir)


def write_draftable(source: Path, out_dir: Path, draft_layers: int, last_scale: float) -> Path:
    """Write (or reuse) a copy of ``source`` whose first ``draft_layers`` layers predict most of
    its output, as a trained draft model would: the attention and MLP outputs of the layers in
    between are zero and the last layer's are scaled by ``last_scale``.

    Every layer still runs at full size (a dense matmul costs the same whatever the values), so
    the decode cost is the source's; only which tokens come out changes. With random weights a
    draft of the source's own first layers agrees with it on almost no token.
    """
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    stamp = {"draft_layers": draft_layers, "last_scale": last_scale}
    if _derived(source, out_dir, stamp, ("model.safetensors",)):
        return out_dir
    num_layers = json.loads((Path(source) / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(Path(source) / "model.safetensors"))
    for i in range(draft_layers, num_layers):
        scale = last_scale if i == num_layers - 1 else 0.0
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            tensors[key] = tensors[key] * scale
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return _finish(out_dir)


def describe_model(path: Path) -> dict[str, Any]:
    """Shape, parameter count and the weight bytes one decode step must read, from the files."""
    config = json.loads((path / "config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")
    total = sum(sizes.values())
    embed = sizes.get("model.embed_tokens.weight", 0)
    tied = bool(config.get("tie_word_embeddings")) or "lm_head.weight" not in sizes
    # An untied embedding is only gathered (one row per token); a tied one doubles as the LM head
    # and is read whole every step.
    per_token = total if tied else total - embed
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[config["torch_dtype"]]
    return {
        "path": str(path),
        "architecture": config["architectures"][0],
        "dtype": config["torch_dtype"],
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "vocab_size": config["vocab_size"],
        "tied_embeddings": tied,
        "num_parameters": total // itemsize,
        "weight_bytes": total,
        "weight_bytes_per_token": per_token,
        "kv_bytes_per_token": 2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * config["head_dim"]
        * itemsize,
    }


def safetensors_sizes(path: Path) -> dict[str, int]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {
        name: meta["data_offsets"][1] - meta["data_offsets"][0]
        for name, meta in header.items()
        if name != "__metadata__"
    }
