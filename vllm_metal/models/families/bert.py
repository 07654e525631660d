"""BERT in MLX: an encoder-only transformer for embeddings and sequence classification.

The module tree mirrors transformers' `BertModel`, so a checkpoint's tensor names are this tree's
parameter names (`embeddings.word_embeddings.weight`, `encoder.layer.0.attention.self.query.weight`,
`pooler.dense.weight`, ...), with a `bert.` prefix under `BertForSequenceClassification`.

Every forward runs on a padded batch `[S, L]`: token ids, token type ids and positions per row, and
an additive key-padding mask `[S, 1, 1, L]` that keeps each row's queries on its own real tokens.
Attention is bidirectional; each layer is post-LN (residual add, then LayerNorm), as in BERT.
RoBERTa and XLM-RoBERTa (`xlm_roberta.py`) reuse these layers with their own embeddings and head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("bert",)
KIND = "pooling"
MODALITIES: tuple[str, ...] = ()

# hidden_act -> function. "gelu" is the exact erf form (HF and vLLM both); "gelu_new" and
# "gelu_pytorch_tanh" are the tanh approximation.
ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
}


@dataclass(frozen=True)
class EncoderArgs:
    """The config.json fields an encoder reads; an optional field a config leaves out takes
    transformers' BertConfig default."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int | None = None

    @classmethod
    def from_config(
        cls, config: dict[str, Any], *, pad_token_id: int, with_labels: bool
    ) -> EncoderArgs:
        act = config.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported; choose from {sorted(ACTIVATIONS)}"
            )
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported")
        num_labels = None
        if with_labels:
            # transformers writes id2label (num_labels is derived from it); 2 is its default.
            num_labels = len(config["id2label"]) if "id2label" in config else 2
            num_labels = int(config.get("num_labels", num_labels))
        pad = config.get("pad_token_id")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            hidden_act=act,
            max_position_embeddings=config.get("max_position_embeddings", 512),
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            pad_token_id=pad_token_id if pad is None else int(pad),
            num_labels=num_labels,
        )


# --------------------------------------------------------------------------------------------------
# Embeddings and layers
# --------------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.position_offset = 0  # RoBERTa counts from padding_idx + 1

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers."""
        return self.position_embeddings.weight.shape[0] - self.position_offset

    def __call__(self, token_ids: mx.array, token_types: mx.array, positions: mx.array) -> mx.array:
        x = self.word_embeddings(token_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        x = x + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """q, k, v projections (with biases) and scaled dot-product attention over all heads."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        if args.hidden_size % args.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.num_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.query = nn.Linear(args.hidden_size, args.hidden_size)
        self.key = nn.Linear(args.hidden_size, args.hidden_size)
        self.value = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        batch, length, _ = x.shape

        def heads(t: mx.array) -> mx.array:  # [S, L, H*D] -> [S, H, L, D]
            return t.reshape(batch, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)


class BertDenseNorm(nn.Module):
    """A projection added to the residual, then LayerNorm (BERT's SelfOutput and Output)."""

    def __init__(self, in_dim: int, out_dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, out_dim)
        self.LayerNorm = nn.LayerNorm(out_dim, eps=eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.self = BertSelfAttention(args)
        self.output = BertDenseNorm(args.hidden_size, args.hidden_size, args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.intermediate_size)
        self.act = ACTIVATIONS[args.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """Post-LN block: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.attention = BertAttention(args)
        self.intermediate = BertIntermediate(args)
        self.output = BertDenseNorm(args.intermediate_size, args.hidden_size, args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.layer = [BertLayer(args) for _ in range(args.num_hidden_layers)]

    def __call__(self, x: mx.array, mask: mx.array | None) -> mx.array:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    """dense + tanh on a first-token hidden state (the caller picks the token)."""

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def __call__(self, first: mx.array) -> mx.array:
        return mx.tanh(self.dense(first))


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


class BertModel(nn.Module):
    """Embeddings and encoder; the pooler only when a classifier head uses it."""

    embeddings_class = BertEmbeddings
    head_prefixes: tuple[str, ...] = ()

    def __init__(self, args: EncoderArgs, *, with_pooler: bool = False):
        super().__init__()
        self.args = args
        self.embeddings = self.embeddings_class(args)
        self.encoder = BertEncoder(args)
        if with_pooler:
            self.pooler = BertPooler(args)

    @property
    def encoder_model(self) -> BertModel:
        return self

    def __call__(
        self,
        token_ids: mx.array,
        token_types: mx.array,
        positions: mx.array,
        mask: mx.array | None,
    ) -> mx.array:
        """`[S, L]` ids, types and positions and an additive `[S, 1, 1, L]` mask in the compute
        dtype (None when no row is padded) -> hidden states `[S, L, hidden]`."""
        return self.encoder(self.embeddings(token_ids, token_types, positions), mask)


class BertForSequenceClassification(nn.Module):
    """`bert` (with its pooler) and a linear `classifier` on the pooled first token."""

    # Head modules: vLLM runs pooling heads in float32 (ModelConfig.head_dtype).
    head_prefixes = ("bert.pooler.", "classifier.")

    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.bert = BertModel(args, with_pooler=True)
        self.classifier = nn.Linear(args.hidden_size, args.num_labels)

    @property
    def encoder_model(self) -> BertModel:
        return self.bert

    def classify(self, first: mx.array) -> mx.array:
        return self.classifier(self.bert.pooler(first))
