"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa) for embeddings, reranking and classification.

`load_encoder` builds the family's MLX module from config.json (`families/bert.py`,
`families/xlm_roberta.py`), loads the checkpoint's safetensors into it strictly and wraps it in an
`EncoderAdapter`, the runner's view: `encode` turns packed token ids into final hidden states and
`classify` runs the checkpoint's classification head on pooled rows. Pooling itself (CLS, mean,
normalisation) is the runner's business; it follows vLLM's pooler config.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

from vllm_metal.models.families import bert, xlm_roberta
from vllm_metal.models.loaders import load_strict, parameter_bytes, read_safetensors

ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})

# architectures[0] -> (model class, the model_types it belongs to, default pad_token_id)
_ROBERTA = ({"roberta", "xlm-roberta"}, xlm_roberta.ROBERTA_PAD_TOKEN_ID)
ARCHITECTURES: dict[str, tuple[type[nn.Module], set[str], int]] = {
    "BertModel": (bert.BertModel, {"bert"}, 0),
    "BertForSequenceClassification": (bert.BertForSequenceClassification, {"bert"}, 0),
    "RobertaModel": (xlm_roberta.RobertaModel, *_ROBERTA),
    "RobertaForSequenceClassification": (xlm_roberta.RobertaForSequenceClassification, *_ROBERTA),
    "XLMRobertaModel": (xlm_roberta.RobertaModel, *_ROBERTA),
    "XLMRobertaForSequenceClassification": (
        xlm_roberta.RobertaForSequenceClassification,
        *_ROBERTA,
    ),
}
# Buffers some checkpoints carry next to the weights; they are not parameters.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


class EncoderAdapter:
    """The runner's view of an encoder-only model."""

    def __init__(self, model: nn.Module, config: dict[str, Any], model_type: str):
        encoder = model.encoder_model
        args: bert.EncoderArgs = encoder.args
        self.model = model
        self.config = config
        self.model_type = model_type
        self.weight_bytes = parameter_bytes(model)
        self.num_layers = args.num_hidden_layers
        self.hidden_size = args.hidden_size
        self.num_labels = args.num_labels if hasattr(model, "classify") else None
        self.max_length = encoder.embeddings.max_length  # longest sequence `encode` takes
        self.dtype = encoder.embeddings.word_embeddings.weight.dtype
        self._encoder = encoder
        self._uses_token_types = args.type_vocab_size > 1

    def encode(
        self, token_ids: mx.array, token_type_ids: mx.array | None, seq_lens: Sequence[int]
    ) -> mx.array:
        """token_ids [T] int32 packing S whole sequences back to back (lengths seq_lens, sum T);
        token_type_ids [T] or None (= all 0; ignored by models with one token type). Returns the
        final hidden states [T, hidden] in the compute dtype, each sequence attending
        bidirectionally to its own tokens only; positions restart at each sequence.

        Sequences of similar length run together as padded batches [n, longest] with a
        key-padding mask (`length_groups`), so a long prompt does not pad many short ones."""
        lens = np.asarray(seq_lens, dtype=np.int64)
        if lens.ndim != 1 or lens.size == 0 or lens.min() < 1:
            raise ValueError(f"seq_lens must be one or more positive lengths, got {seq_lens}")
        if token_ids.shape != (int(lens.sum()),):
            raise ValueError(f"token_ids has shape {token_ids.shape}; seq_lens sum to {lens.sum()}")
        longest = int(lens.max())
        if longest > self.max_length:
            raise ValueError(
                f"a sequence of {longest} tokens exceeds the model's {self.max_length}"
            )
        if token_type_ids is None or not self._uses_token_types:
            token_type_ids = None
        starts = np.cumsum(lens) - lens
        groups = length_groups(lens)
        outputs = [
            self._encode_padded(token_ids, token_type_ids, starts[g], lens[g]) for g in groups
        ]
        if len(groups) == 1 and np.array_equal(groups[0], np.arange(lens.size)):
            return outputs[0]
        # The groups' rows, concatenated, are a permutation of the packed rows: undo it.
        source = np.concatenate(
            [np.arange(starts[i], starts[i] + lens[i]) for g in groups for i in g]
        )
        return mx.concatenate(outputs)[mx.array(np.argsort(source).astype(np.int32))]

    def _encode_padded(
        self,
        token_ids: mx.array,
        token_type_ids: mx.array | None,
        starts: np.ndarray,
        lens: np.ndarray,
    ) -> mx.array:
        """The sequences at `starts` (lengths `lens`) as one padded batch; their rows in order."""
        longest = int(lens.max())
        cols = np.arange(longest)
        valid = cols[None, :] < lens[:, None]  # [n, L]
        # Where each padded slot reads from in the packed input (pad slots repeat a real token).
        gather = starts[:, None] + np.minimum(cols[None, :], lens[:, None] - 1)
        gather = mx.array(gather.astype(np.int32))
        ids = token_ids[gather]
        if token_type_ids is None:
            types = mx.zeros(ids.shape, dtype=mx.int32)
        else:
            types = token_type_ids[gather]
        positions = mx.broadcast_to(mx.array(cols, dtype=mx.int32), ids.shape)
        mask = None
        if not valid.all():
            blocked = np.where(valid, 0.0, float(mx.finfo(self.dtype).min)).astype(np.float32)
            mask = mx.array(blocked[:, None, None, :]).astype(self.dtype)

        hidden = self._encoder(ids, types, positions, mask).reshape(-1, self.hidden_size)
        if mask is None:
            return hidden
        # Row-major order of the real slots is the sequences' order.
        return hidden[mx.array(np.flatnonzero(valid.reshape(-1)).astype(np.int32))]

    def classify(self, pooled: mx.array) -> mx.array:
        """[N, hidden] first-token hidden states -> [N, num_labels] raw float32 logits through the
        checkpoint's head (BERT: pooler dense + tanh, then classifier; RoBERTa: dense + tanh +
        out_proj). The head runs in float32, as vLLM's pooling heads do."""
        if self.num_labels is None:
            raise ValueError(f"this {self.model_type} checkpoint has no classification head")
        return self.model.classify(pooled.astype(mx.float32))


def length_groups(lens: np.ndarray, max_padding: float = 0.5) -> list[np.ndarray]:
    """Sequence indices in groups of similar length, longest first: a group's padded size
    (members x its longest) exceeds its real tokens by at most `max_padding` of the padded size,
    except for a group of one."""
    order = np.argsort(-lens, kind="stable")
    groups: list[list[int]] = []
    real = 0
    for i in order.tolist():
        if groups and (len(groups[-1]) + 1) * lens[groups[-1][0]] * (1 - max_padding) <= (
            real + lens[i]
        ):
            groups[-1].append(i)
            real += int(lens[i])
        else:
            groups.append([i])
            real = int(lens[i])
    return [np.asarray(g, dtype=np.int64) for g in groups]


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _map_names(
    tensors: dict[str, tuple[mx.array, str]], expected: dict[str, mx.array]
) -> dict[str, tuple[mx.array, str]]:
    """Checkpoint names -> this module tree's names."""
    mapped = {}
    for name, entry in tensors.items():
        # Original Google BERT checkpoints name LayerNorm parameters gamma and beta.
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        if not name.endswith(_BUFFERS):
            mapped[name] = entry
    # A bare encoder checkpoint saved from a wrapper keeps the wrapper's prefix.
    for prefix in ("bert.", "roberta."):
        if not any(k.startswith(prefix) for k in expected) and all(
            k.startswith(prefix) for k in mapped
        ):
            mapped = {k.removeprefix(prefix): v for k, v in mapped.items()}
    # *Model checkpoints carry the BERT pooler, which embeddings never use.
    if not any(k.startswith("pooler.") for k in expected):
        mapped = {k: v for k, v in mapped.items() if not k.startswith("pooler.")}
    return mapped


def load_encoder(path: Path, config: dict[str, Any], compute_dtype: mx.Dtype) -> EncoderAdapter:
    """Build the encoder family for `config`, load the checkpoint at `path` strictly (a missing,
    unexpected or misshapen tensor is a ValueError naming it), cast floats to `compute_dtype`
    (classification heads to float32) and wrap it for the runner."""
    path = Path(path)
    model_type = config.get("model_type")
    if model_type not in ENCODER_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not an encoder-only family handled here")
    architecture = (config.get("architectures") or [None])[0]
    if architecture is None:
        architecture = "BertModel" if model_type == "bert" else "XLMRobertaModel"
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; choose from {sorted(ARCHITECTURES)}"
        )
    cls, model_types, pad_token_id = ARCHITECTURES[architecture]
    if model_type not in model_types:
        raise ValueError(f"architecture {architecture} does not belong to model_type {model_type}")

    args = bert.EncoderArgs.from_config(
        config, pad_token_id=pad_token_id, with_labels=hasattr(cls, "classify")
    )
    model = cls(args)
    expected = dict(tree_flatten(model.parameters()))
    tensors = _map_names(read_safetensors(path), expected)
    load_strict(
        model,
        tensors,
        path=path,
        what=architecture,
        dtype_of=lambda name: mx.float32 if name.startswith(model.head_prefixes) else compute_dtype,
    )
    return EncoderAdapter(model, config, model_type)
