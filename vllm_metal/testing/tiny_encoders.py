"""Tiny random-weight encoder checkpoints (BERT, XLM-RoBERTa) for embedding, classification and
reranking tests that cannot download models.

Kinds:

- `bert-embed`: `BertModel` in sentence-transformers layout (`modules.json` with Transformer,
  mean Pooling and Normalize), the layout of e.g. all-MiniLM-L6-v2;
- `bert-cls`: `BertForSequenceClassification`, three labels, a WordPiece tokenizer that gives text
  pairs token type ids;
- `xlmr-rerank`: `XLMRobertaForSequenceClassification` with one label, a cross-encoder;
- `xlmr-embed`: `XLMRobertaModel` without `modules.json` (vLLM then pools the first token).

transformers builds and saves the models (float32 init, then cast to `dtype`), so the files are
what `save_pretrained` writes. Weights are redrawn wider than transformers' 0.02 init so that
different inputs give clearly different outputs. The tokenizers (a WordPiece for BERT, a Unigram
for XLM-R, with their special tokens and pair templates) get a vocabulary built deterministically
from the corpus of `tiny_tokenizer.py`: the same arguments always give the same checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from vllm_metal.testing.tiny_tokenizer import _CORPUS

KINDS = ("bert-embed", "bert-cls", "bert-rerank", "xlmr-rerank", "xlmr-embed")
DTYPES = ("float32", "float16", "bfloat16")

BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4
XLMR_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3; <mask> is the last id
TOKENIZER_VOCAB_SIZE = 512
CLS_LABELS = {0: "negative", 1: "neutral", 2: "positive"}

# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def _word_counts(normalize: Any, pre_tokenize: Any) -> Counter[str]:
    """How often each pre-tokenized word of the corpus occurs."""
    counts: Counter[str] = Counter()
    for line in _CORPUS.splitlines():
        if line.strip():
            text = normalize.normalize_str(line.strip())
            counts.update(word for word, _ in pre_tokenize.pre_tokenize_str(text))
    return counts


def _vocabulary(counts: Counter[str], pieces: list[str], size: int) -> list[str]:
    """``pieces``, then the most frequent words (ties by spelling) up to ``size`` entries.

    Built by hand rather than by the `tokenizers` trainers, whose WordPiece and Unigram results
    change from process to process."""
    vocab = list(dict.fromkeys(pieces))
    for word, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(vocab) == size:
            break
        if word not in vocab:
            vocab.append(word)
    return vocab


def build_bert_tokenizer() -> Any:
    """A lower-casing WordPiece tokenizer: `[CLS] A [SEP]`, pairs `[CLS] A [SEP] B [SEP]` with
    token type 1 on the second segment. Vocabulary: the specials, every corpus character alone
    and as a `##` continuation, then whole words by frequency."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts = _word_counts(normalizer, pre_tokenizer)
    chars = sorted({c for word in counts for c in word})
    pieces = [*BERT_SPECIALS, *chars, *(f"##{c}" for c in chars)]
    vocab = _vocabulary(counts, pieces, TOKENIZER_VOCAB_SIZE)
    tokenizer = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(list(BERT_SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, vocab.index(t)) for t in ("[CLS]", "[SEP]")],
    )
    return tokenizer


def build_xlmr_tokenizer() -> Any:
    """A SentencePiece-style Unigram tokenizer: `<s> A </s>`, pairs `<s> A </s> </s> B </s>` with
    no token types (all 0). Vocabulary: the specials, `▁` and every corpus character, then
    `▁`-prefixed whole words by frequency, scored by their log frequency; `<mask>` last."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " ")])
    pre_tokenizer = pre_tokenizers.Metaspace()
    counts = _word_counts(normalizer, pre_tokenizer)
    chars = sorted({c for word in counts for c in word} | {"▁"})
    vocab = _vocabulary(counts, [*XLMR_SPECIALS, *chars], TOKENIZER_VOCAB_SIZE - 1)
    total = sum(counts.values())
    # Log frequencies; lone characters score below any word, so known words stay whole.
    rare = math.log(0.5 / total) - 5.0

    def score(piece: str) -> float:
        if piece in XLMR_SPECIALS:
            return 0.0
        return math.log(counts[piece] / total) if piece in counts else rare

    scored = [(t, score(t)) for t in vocab]
    tokenizer = Tokenizer(models.Unigram(scored, unk_id=XLMR_SPECIALS.index("<unk>")))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.add_special_tokens(list(XLMR_SPECIALS))
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    return tokenizer


def _tokenizer_files(tokenizer: Any, bert_style: bool) -> dict[str, Any]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    if bert_style:
        specials = {
            "unk_token": "[UNK]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "cls_token": "[CLS]",
            "mask_token": "[MASK]",
        }
        # transformers 5's PreTrainedTokenizerFast returns token_type_ids only when listed here,
        # and a cross-encoder scores differently without them.
        input_names = ["input_ids", "token_type_ids", "attention_mask"]
    else:
        specials = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "sep_token": "</s>",
            "pad_token": "<pad>",
            "cls_token": "<s>",
            "mask_token": "<mask>",
        }
        input_names = ["input_ids", "attention_mask"]
    added = json.loads(tokenizer.to_str())["added_tokens"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_input_names": input_names,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k]
                for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in added
        },
    }
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": config,
        "special_tokens_map.json": specials,
    }


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def _build_model(
    kind: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int
) -> Any:
    """A float32 transformers model of ``kind`` with transformers' default (narrow) init."""
    import transformers as tf

    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "intermediate_size": 4 * hidden_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    if kind.startswith("bert"):
        config = tf.BertConfig(
            max_position_embeddings=512, type_vocab_size=2, pad_token_id=0, **common
        )
    else:
        # XLM-R: positions start at pad + 1, so 514 rows cover 512 tokens; one token type.
        config = tf.XLMRobertaConfig(
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **common,
        )
    # transformers 5 dropped this field, but vLLM 0.32 reads it from XLM-R configs (to tell Jina's
    # rotary variant apart) and fails without it; checkpoints written earlier all carry it.
    config.position_embedding_type = "absolute"
    if kind == "bert-cls":
        config.id2label = dict(CLS_LABELS)
        config.label2id = {v: k for k, v in CLS_LABELS.items()}
        return tf.BertForSequenceClassification(config)
    if kind == "bert-rerank":  # a cross-encoder that reads the pair's token types
        config.num_labels = 1
        return tf.BertForSequenceClassification(config)
    if kind == "xlmr-rerank":
        config.num_labels = 1
        return tf.XLMRobertaForSequenceClassification(config)
    return tf.BertModel(config) if kind == "bert-embed" else tf.XLMRobertaModel(config)


def _widen_weights(model: Any, seed: int, weight_std: float) -> None:
    """Redraw every parameter: matrices and embeddings ~ N(0, weight_std), biases ~ N(0, 0.1),
    LayerNorm scales ~ 1 + N(0, 0.1). transformers' 0.02 init makes every input look alike."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("LayerNorm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(weight_std * noise)


def _sentence_transformers_files(hidden_size: int) -> dict[str, Any]:
    """modules.json and the module configs of a Transformer -> mean Pooling -> Normalize model."""
    layout = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{name}"}
        for i, (path, name) in enumerate(layout)
    ]
    pooling = {
        "word_embedding_dimension": hidden_size,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": False,
        "include_prompt": True,
    }
    return {
        "modules.json": modules,
        "1_Pooling/config.json": pooling,
        "sentence_bert_config.json": {"max_seq_length": 512, "do_lower_case": False},
    }


def write_tiny_encoder(
    out_dir: str | Path,
    kind: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int | None = None,
    weight_std: float = 0.2,
) -> Path:
    """Write a random-weight encoder checkpoint of ``kind`` (one of `KINDS`) to ``out_dir`` and
    return it. The same arguments always give the same weights and tokenizer. The MLP is 4 x
    ``hidden_size``; ``vocab_size`` (default: the tokenizer's) may be larger than the tokenizer's
    vocabulary, as in real checkpoints (benchmarks)."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    bert_style = kind.startswith("bert")
    tokenizer = build_bert_tokenizer() if bert_style else build_xlmr_tokenizer()
    vocab = tokenizer.get_vocab_size() if vocab_size is None else vocab_size
    model = _build_model(kind, vocab, hidden_size, num_layers, num_heads)
    # Mix the kind into the seed: two kinds never share an encoder by accident.
    _widen_weights(model, seed * len(KINDS) + KINDS.index(kind), weight_std)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    files = _tokenizer_files(tokenizer, bert_style)
    if kind == "bert-embed":
        files.update(_sentence_transformers_files(hidden_size))
        (out / "2_Normalize").mkdir(exist_ok=True)
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_metal.testing.tiny_encoders",
        description="Write a tiny random-weight encoder checkpoint and print its path.",
    )
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_tiny_encoder(args.out, args.kind, dtype=args.dtype, seed=args.seed).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
