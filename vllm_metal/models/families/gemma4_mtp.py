"""Gemma 4's multi-token-prediction assistant (model_type `gemma4_assistant`, published beside each
Gemma 4 model; vLLM's `Gemma4MTP`), the drafter of `--speculative-config '{"method": "mtp",
"model": ASSISTANT}'` on a Gemma 4 text target.

The assistant is a small Gemma 4 decoder of its own width whose attention layers are all
KV-shared: each computes queries only and attends over the target's K/V of the last target layer
of its kind (sliding or full) that has K/V of its own (`source_layers`). Its input at the target's
position p is `pre_projection` of [the target's scaled embedding of the token at p + 1, the
target's final (normed) hidden state at p]; after its layers and final norm its own LM head
predicts the token at p + 2, and `post_projection` maps its output back to the target's width,
where it stands in for the target's hidden state at the next draft step. Every draft step keeps
position p and the target's K/V up to p (vLLM's `constant_draft_positions`; transformers'
candidate generator rotates the query at p + 1 instead, vLLM and mlx-vlm at p). With
`use_ordered_embeddings` its LM head scores only the tokens of the top centroids
(`centroid_intermediate_top_k` of `num_centroids`, the token ids of each listed in
`token_ordering`); drafts are their argmax, never a token of the assistant's generation config's
`suppress_tokens` (as vLLM's full-vocabulary head masks them). The layers are mlx-lm 0.32.2's `gemma4_text`
decoder layers, which run on the paged pool through `families.gemma4`'s attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.gemma4_text import DecoderLayer, ModelArgs

from vllm_metal.models.families import gemma4
from vllm_metal.models.hf_config import mlx_lm_overrides
from vllm_metal.ops.argmax import row_argmax

# The targets this assistant drafts for (`families.mtp_model_types`).
MODEL_TYPES = gemma4.MODEL_TYPES
# The drafter's model type as vLLM names it once it reads an assistant's config.
DRAFT_MODEL_TYPES = ("gemma4_mtp",)
CHECKPOINT_MODEL_TYPE = "gemma4_assistant"
# The head is a checkpoint of its own (`--speculative-config` `model`), not tensors of the target's.
HEAD_IN_TARGET = False


class MaskedHead(nn.Module):
    """The LM head restricted to the tokens of the top `top_k` centroids of each row."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(
                f"{CHECKPOINT_MODEL_TYPE}: vocab_size {vocab_size} is not a multiple of "
                f"num_centroids {num_centroids}"
            )
        self.top_k = top_k
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab_size,), dtype=mx.int32)

    def candidates(self, h: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
        """The candidate token ids of each row of `h` (`[T, hidden]`) and their logits, both
        `[T, top_k * tokens per centroid]`."""
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[:, : self.top_k]
        clusters = self.token_ordering.reshape(scores.shape[-1], -1)
        ids = clusters[top].reshape(h.shape[0], -1)
        logits = (weight[ids] @ h[:, :, None])[..., 0]
        return ids, logits


class Assistant(nn.Module):
    def __init__(self, args: ModelArgs, backbone_size: int, config: dict[str, Any]):
        super().__init__()
        size = args.hidden_size
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, size)
        self.model.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.model.norm = nn.RMSNorm(size, eps=args.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * backbone_size, size, bias=False)
        self.post_projection = nn.Linear(size, backbone_size, bias=False)
        if not config.get("tie_word_embeddings", True):
            self.lm_head = nn.Linear(size, args.vocab_size, bias=False)
        # The tokens the assistant never drafts (its generation config's `suppress_tokens`, as
        # vLLM masks them): a bool per vocabulary entry, or None. Not a parameter.
        self._suppressed: mx.array | None = None
        self.masked_embedding = None
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedHead(
                size,
                args.vocab_size,
                int(config.get("num_centroids", 2048)),
                int(config.get("centroid_intermediate_top_k", 32)),
            )

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def __call__(self, inputs: mx.array, caches: list[Any]) -> tuple[mx.array, mx.array]:
        """From `inputs` = [target embedding, target hidden state] (`[T, 1, 2 * backbone]`):
        the normed output (`[T, 1, hidden]`, for the LM head) and its projection to the
        target's width (`[T, 1, backbone]`, the next draft step's hidden state). `caches[i]`:
        the paged view layer i attends over."""
        h = self.pre_projection(inputs)
        for layer, cache in zip(self.layers, caches):
            h, _, _ = layer(h, None, cache)
        h = self.model.norm(h)
        return h, self.post_projection(h)

    def suppress(self, token_ids: list[int]) -> None:
        self._suppressed = None
        if token_ids:
            mask = mx.zeros((self.args.vocab_size,), dtype=mx.bool_)
            mask[mx.array(token_ids, dtype=mx.int32)] = True
            self._suppressed = mask

    def _scored(self, h: mx.array) -> tuple[mx.array | None, mx.array]:
        """The token ids each row scores (None: the whole vocabulary) and their logits, the
        suppressed tokens at -inf."""
        weight = self._head_weight()
        if self.masked_embedding is None:
            ids, logits = None, h @ weight.T
            suppressed = None if self._suppressed is None else self._suppressed[None]
        else:
            ids, logits = self.masked_embedding.candidates(h, weight)
            suppressed = None if self._suppressed is None else self._suppressed[ids]
        if suppressed is not None:
            logits = mx.where(suppressed, mx.array(-mx.inf, dtype=logits.dtype), logits)
        return ids, logits

    def _head_weight(self) -> mx.array:
        head = self.lm_head if "lm_head" in self else self.model.embed_tokens
        return head.weight

    def logits(self, h: mx.array) -> mx.array:
        """Full-vocabulary logits (`[T, V]`) of normed outputs; with ordered embeddings every
        token outside the selected centroids is -inf."""
        ids, logits = self._scored(h.reshape(-1, h.shape[-1]))
        if ids is None:
            return logits
        full = mx.full((logits.shape[0], self.args.vocab_size), -mx.inf, dtype=logits.dtype)
        return mx.put_along_axis(full, ids, logits, axis=-1)

    def argmax(self, h: mx.array) -> mx.array:
        """The draft token of each normed output (`[T]`), without full-vocabulary logits where
        the head is masked."""
        ids, logits = self._scored(h.reshape(-1, h.shape[-1]))
        if ids is None:
            return row_argmax(logits)
        best = row_argmax(logits)[:, None]
        return mx.take_along_axis(ids, best, axis=-1)[:, 0]


def source_layers(target: dict[str, Any], assistant_text: dict[str, Any]) -> list[int]:
    """The target layer whose K/V each assistant layer attends over: the last target layer of
    the assistant layer's kind that has K/V of its own (before `num_kv_shared_layers`)."""
    types = target["layer_types"]
    own = types[: len(types) - int(target.get("num_kv_shared_layers") or 0)]
    last = {kind: i for i, kind in enumerate(own)}
    sources = []
    for i, kind in enumerate(assistant_text["layer_types"]):
        if kind not in last:
            raise ValueError(
                f"{CHECKPOINT_MODEL_TYPE}: layer {i} is {kind}, and the target has no "
                f"{kind} layer with K/V of its own to attend over"
            )
        sources.append(last[kind])
    return sources


def read_config(model_dir: Path) -> dict[str, Any]:
    """The assistant's config as transformers reads it (as vLLM does): the defaults its
    config.json leaves out filled in (`layer_types`, every layer KV-shared)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != CHECKPOINT_MODEL_TYPE:
        raise ValueError(
            f"{model_dir}: model_type {config.model_type!r} is no Gemma 4 MTP assistant "
            f"({CHECKPOINT_MODEL_TYPE})"
        )
    return config.to_dict()


def missing(target: dict[str, Any], config: dict[str, Any]) -> str | None:
    """What keeps the assistant of `config` from drafting for the target text config `target`
    (None where nothing does; the weights are checked when it loads)."""
    text = config["text_config"]
    backbone = config.get("backbone_hidden_size")
    if backbone != target["hidden_size"]:
        return (
            f"its backbone_hidden_size {backbone} is not the target's hidden_size "
            f"{target['hidden_size']}"
        )
    if text["vocab_size"] != target["vocab_size"]:
        return f"its vocab_size {text['vocab_size']} is not the target's {target['vocab_size']}"
    if text.get("sliding_window") != target.get("sliding_window"):
        return (
            f"its sliding_window {text.get('sliding_window')} is not the target's "
            f"{target.get('sliding_window')}"
        )
    try:
        sources = source_layers(target, text)
    except ValueError as error:
        return str(error).split(": ", 1)[1]
    for i, source in enumerate(sources):
        kind = text["layer_types"][i]
        ours, theirs = _kv_shape(text, kind), _kv_shape(target, kind)
        if ours != theirs:
            return (
                f"its layer {i} ({kind}) expects K/V of {ours[0]} heads of {ours[1]}, and the "
                f"target's layer {source} has {theirs[0]} of {theirs[1]}"
            )
    return None


def _kv_shape(config: dict[str, Any], kind: str) -> tuple[int, int]:
    """(KV heads, head size) of a `kind` attention layer of a Gemma 4 text config, as mlx-lm
    builds it."""
    args = ModelArgs.from_dict({**config, **mlx_lm_overrides(config, ModelArgs)})
    full = kind == "full_attention"
    head_dim = args.global_head_dim if full and args.global_head_dim else args.head_dim
    shared = full and args.attention_k_eq_v and args.num_global_key_value_heads is not None
    return (args.num_global_key_value_heads if shared else args.num_key_value_heads), head_dim


def load_assistant(
    model_dir: Path, target: dict[str, Any], compute_dtype: mx.Dtype
) -> tuple[Assistant, list[int]]:
    """The assistant of `model_dir` for the target text config `target`, and the target layer
    each of its layers attends over. Raises ValueError naming what does not fit."""
    from vllm_metal.models.loaders.safetensors import tensor_files

    config = read_config(model_dir)
    problem = missing(target, config)
    if problem is not None:
        raise ValueError(
            f"{model_dir}: the Gemma 4 MTP assistant does not fit its target: {problem}"
        )
    text = config["text_config"]
    # Every layer reads the target's K/V (transformers' config makes them all KV-shared whatever
    # the file says), which is what makes mlx-lm build them without keys and values.
    layers = len(text["layer_types"])
    text = {**text, "num_hidden_layers": layers, "num_kv_shared_layers": layers}
    args = ModelArgs.from_dict({**text, **mlx_lm_overrides(text, ModelArgs)})
    assistant = Assistant(args, int(config["backbone_hidden_size"]), config)
    weights: dict[str, mx.array] = {}
    for path in sorted(set(tensor_files(Path(model_dir)).values())):
        weights |= mx.load(str(path))
    if "masked_embedding.token_ordering" in weights:
        ordering = weights["masked_embedding.token_ordering"].astype(mx.int32)
        weights["masked_embedding.token_ordering"] = ordering
    if "lm_head.weight" in weights and "lm_head" not in assistant:
        del weights["lm_head.weight"]  # tied: the embedding's
    weights = {n: v for n, v in weights.items() if "rotary_emb" not in n}
    assistant.load_weights(list(weights.items()), strict=True)
    assistant.set_dtype(compute_dtype)  # floating parameters only: the ordering stays int32
    generation = Path(model_dir) / "generation_config.json"
    if generation.exists():
        assistant.suppress(json.loads(generation.read_text()).get("suppress_tokens") or [])
    mx.eval(assistant.parameters())
    return assistant, source_layers(target, text)
