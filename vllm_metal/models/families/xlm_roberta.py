"""RoBERTa and XLM-RoBERTa in MLX: BERT's encoder layers (`bert.py`) with RoBERTa's embeddings and
classification head.

Two differences from BERT matter for the numbers:

- positions start at `padding_idx + 1` (`pad_token_id`, 1 in RoBERTa's vocabulary), so the
  position table has two unused rows and a 514-row table covers 512 tokens. Positions count every
  token of a sequence, as vLLM does; transformers would give an in-sequence pad token the pad
  position instead, which never happens in a tokenized prompt.
- `RobertaForSequenceClassification` has no pooler: its head is dense + tanh + `out_proj` on the
  first token (`<s>`), named `classifier.dense` and `classifier.out_proj`.

Checkpoints usually have a token type vocabulary of one entry, and RoBERTa tokenizers return no
token type ids; the adapter ignores token types for such models.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from vllm_metal.models.families.bert import BertEmbeddings, BertModel, EncoderArgs

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("roberta", "xlm-roberta")
KIND = "pooling"
MODALITIES: tuple[str, ...] = ()

# RoBERTa's <pad> id, the default when config.json leaves pad_token_id out.
ROBERTA_PAD_TOKEN_ID = 1


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, args: EncoderArgs):
        super().__init__(args)
        self.position_offset = args.pad_token_id + 1


class RobertaModel(BertModel):
    """A `BertModel` whose embeddings offset positions by `padding_idx + 1`."""

    embeddings_class = RobertaEmbeddings


class RobertaClassificationHead(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)
        self.out_proj = nn.Linear(args.hidden_size, args.num_labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))


class RobertaForSequenceClassification(nn.Module):
    """`roberta` (no pooler) and the classification head on the first token."""

    head_prefixes = ("classifier.",)  # run in float32, as vLLM's head_dtype does

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.roberta = RobertaModel(args)
        self.classifier = RobertaClassificationHead(args)

    @property
    def encoder_model(self) -> RobertaModel:
        return self.roberta

    def classify(self, first: mx.array) -> mx.array:
        return self.classifier(first)
