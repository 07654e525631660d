"""The runner's view of a vision-language model from mlx-vlm: a paged language model, plus
towers that turn media items into rows of input embeddings.

mlx-vlm's `Model` holds `language_model` (embeddings, decoder layers, final norm and head) and the
vision tower and projector under family-specific names. The language model takes the runner's
paged caches as an mlx-lm model does (attention routed through `scaled_dot_product_attention`);
each family (`families/<model_type>.py`) says how its tower maps the processor's tensors of one
item (`pixel_values`, ...) to the rows that replace the item's placeholder tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from vllm_metal.models import attention
from vllm_metal.models.adapter import ModelAdapter


class MultimodalAdapter(ModelAdapter):
    # The modalities the model's towers encode (vLLM's names: "image", "video", "audio").
    modalities: tuple[str, ...] = ("image",)

    @property
    def language_model(self) -> Any:
        return self.model.language_model

    @property
    def decoder(self) -> Any:
        return self.language_model

    @property
    def num_layers(self) -> int:
        return len(self.language_model.layers)

    def install_paged_attention(self) -> None:
        attention.route_module_sdpa(self.language_model)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        lm = self.language_model
        h = input_embeds
        for layer, cache in zip(lm.layers, caches):
            h = layer(h, None, cache)
        return lm.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        lm = self.language_model
        if getattr(lm, "lm_head", None) is None:  # tied embeddings
            return lm.embed_tokens.as_linear(hidden)
        return lm.lm_head(hidden)

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        """One `[rows, hidden]` array per item: the embeddings its placeholder's `is_embed`
        positions take, in order. `items` are the processor's tensors of each item."""
        raise NotImplementedError

    def dummy_item(self, modality: str) -> dict[str, np.ndarray]:
        """The tensors of the largest item the processor produces (profiling and warm-up)."""
        raise NotImplementedError
