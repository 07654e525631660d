"""Pooling variants of the tiny decoder checkpoints (`tiny_models`): a sequence classifier with a
random `score` head, and an embedding model that declares matryoshka dimensions.

Encoder-only pooling checkpoints (BERT, XLM-RoBERTa) are written by `tiny_encoders`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# The `score` head's init: wide enough that the classes' probabilities differ clearly between
# prompts (the tiny decoders' final hidden states have unit RMS).
SCORE_STD = 0.3


def _copy(src: Path, dst: Path) -> dict:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return json.loads((dst / "config.json").read_text())


def write_seq_classifier(src: str | Path, dst: str | Path, num_labels: int, seed: int = 0) -> Path:
    """`src` (a tiny `*ForCausalLM`) as `*ForSequenceClassification` with `num_labels` classes:
    the decoder's weights, no LM head, a random `score.weight` [num_labels, hidden]."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    config = _copy(src, dst)
    arch = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    labels = {str(i): f"LABEL_{i}" for i in range(num_labels)}
    config.update(
        architectures=[arch],
        id2label=labels,
        label2id={v: int(k) for k, v in labels.items()},
        tie_word_embeddings=False,
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(dst / "model.safetensors"))
    dtype = weights["model.embed_tokens.weight"].dtype
    weights.pop("lm_head.weight", None)
    rng = np.random.default_rng(seed)
    score = rng.normal(0.0, SCORE_STD, (num_labels, config["hidden_size"]))
    weights["score.weight"] = torch.from_numpy(score.astype(np.float32)).to(dtype)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_matryoshka(src: str | Path, dst: str | Path, dimensions: list[int]) -> Path:
    """`src` with `matryoshka_dimensions` in its config: vLLM then accepts those `dimensions`."""
    src, dst = Path(src), Path(dst)
    config = _copy(src, dst)
    config["matryoshka_dimensions"] = list(dimensions)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
