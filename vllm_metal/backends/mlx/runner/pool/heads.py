"""The pooling heads: vLLM's own poolers, fed with the MLX model's hidden states.

vLLM's `DispatchPooler` (torch, on the host) does what a pooling request asks for after the
model: CLS / LAST / MEAN / ALL pooling across prefill chunks, the sentence-transformers projector,
matryoshka `dimensions`, normalisation, logit calibration and the sigmoid / softmax of
classifiers, so every `PoolingParams` field means here what it means on vLLM's other backends.
This module builds that pooler for the model and supplies the one model-specific part, the
classifier:

- an encoder's own head (BERT's pooler and classifier, RoBERTa's classification head), in MLX;
- a decoder's `score` layer (`*ForSequenceClassification`, `--convert classify`);
- a reranker made from the LM head (`classifier_from_token` with `method` `from_2_way_softmax`,
  as Qwen3-Reranker: the score row is `lm_head[yes] - lm_head[no]`, or `no_post_processing`: the
  rows of the listed tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm_metal.models.loaders.safetensors import resolve_model_path

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.pooler import Pooler

Classifier = Callable[[torch.Tensor], torch.Tensor]


def is_classifier(vllm_config: VllmConfig) -> bool:
    """Whether vLLM serves the model as a classifier (else as an embedding model)."""
    model = vllm_config.model_config
    return model.convert_type == "classify" or any(
        "ForSequenceClassification" in arch for arch in model.architectures or ()
    )


def build_pooler(
    vllm_config: VllmConfig, classifier: Classifier | None, *, token_classify: bool = True
) -> Pooler:
    """vLLM's pooler for the model: embed + token_embed, or classify (+ token_classify, which
    applies `classifier` to every token: off for classifiers meant for one pooled row only)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.pooler import DispatchPooler
    from vllm.model_executor.layers.pooler.seqwise import pooler_for_classify

    pooler_config = vllm_config.model_config.pooler_config
    # vLLM's pooler builders read the model config (head dtype, the sentence-transformers
    # projector, the classifier activation) from the current config.
    with set_current_vllm_config(vllm_config):
        if classifier is None:
            return DispatchPooler.for_embedding(pooler_config)
        if token_classify:
            return DispatchPooler.for_seq_cls(pooler_config, classifier=classifier)
        return DispatchPooler(
            {"classify": pooler_for_classify(pooler_config, classifier=classifier)}
        )


def decoder_classifier(vllm_config: VllmConfig) -> Classifier:
    """The classifier of a decoder served for `classify`: a linear map of the hidden state."""
    model = vllm_config.model_config
    hf_config = model.hf_config
    text_config = hf_config.get_text_config()
    tokens = _config_attr(hf_config, text_config, "classifier_from_token")
    method = _config_attr(hf_config, text_config, "method")
    path = resolve_model_path(model.model, model.revision, vllm_config.load_config.download_dir)
    reader = _CheckpointReader(path)
    if tokens is None and method is None:
        weight = reader.get("score.weight")
        bias = reader.get("score.bias", required=False)
    else:
        weight, bias = _weight_from_lm_head(vllm_config, reader, list(tokens or ()), method), None
    num_labels = hf_config.num_labels
    if weight.shape != (num_labels, model.get_hidden_size()):
        raise ValueError(
            f"model={model.model!r}: the classifier is {tuple(weight.shape)}, expected "
            f"({num_labels}, {model.get_hidden_size()}) for num_labels={num_labels}"
        )
    dtype = model.head_dtype
    return _linear(weight.to(dtype), None if bias is None else bias.to(dtype))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Classifier:
    def classify(pooled: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(pooled.to(weight.dtype), weight, bias)

    return classify


def _config_attr(hf_config: Any, text_config: Any, name: str) -> Any:
    return getattr(hf_config, name, getattr(text_config, name, None))


def _weight_from_lm_head(
    vllm_config: VllmConfig, reader: _CheckpointReader, tokens: list[str], method: str | None
) -> torch.Tensor:
    """The classifier rows vLLM derives from the LM head for `classifier_from_token`."""
    from vllm.tokenizers import get_tokenizer

    model = vllm_config.model_config
    if method not in ("from_2_way_softmax", "no_post_processing"):
        raise ValueError(
            f"model={model.model!r}: classifier method={method!r} is not supported; "
            "use 'from_2_way_softmax' or 'no_post_processing'"
        )
    tokenizer = get_tokenizer(
        model.tokenizer,
        revision=model.tokenizer_revision,
        tokenizer_mode=model.tokenizer_mode,
        trust_remote_code=model.trust_remote_code,
    )
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unknown = [t for t, i in zip(tokens, ids) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(
            f"model={model.model!r}: classifier_from_token {unknown!r} are not tokens of the "
            "tokenizer's vocabulary"
        )
    tied = bool(getattr(model.hf_config.get_text_config(), "tie_word_embeddings", False))
    head = "model.embed_tokens" if tied else "lm_head"
    rows = reader.rows(head, ids).to(torch.float32)
    if method == "from_2_way_softmax":
        if len(ids) != 2:
            raise ValueError(
                f"model={model.model!r}: from_2_way_softmax needs two classifier_from_token "
                f"entries, got {tokens!r}"
            )
        return rows[1:2] - rows[0:1]  # yes - no: sigmoid of it is the 2-way softmax of yes
    return rows


class _CheckpointReader:
    """Reads single tensors (or rows of them) from a safetensors checkpoint without loading it."""

    def __init__(self, path: Path):
        from vllm_metal.models.loaders.safetensors import tensor_files

        self.path = path
        self._where = tensor_files(path)

    def get(self, name: str, *, required: bool = True) -> torch.Tensor | None:
        from safetensors import safe_open

        file = self._where.get(name)
        if file is None:
            if required:
                raise ValueError(f"{self.path}: the checkpoint has no tensor {name!r}")
            return None
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)

    def rows(self, module: str, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of `module`'s weight, dequantized if the checkpoint is MLX-quantized."""
        weight = self.get(f"{module}.weight")
        scales = self.get(f"{module}.scales", required=False)
        if scales is None:
            return weight[ids]
        import mlx.core as mx
        import numpy as np

        quantization = json.loads((self.path / "config.json").read_text())["quantization"]
        biases = self.get(f"{module}.biases", required=False)
        dense = mx.dequantize(
            mx.array(weight[ids].numpy()),
            mx.array(scales[ids].float().numpy()),
            None if biases is None else mx.array(biases[ids].float().numpy()),
            group_size=quantization["group_size"],
            bits=quantization["bits"],
        )
        return torch.from_numpy(np.asarray(dense.astype(mx.float32)))
