"""OLMo 2: mlx-lm's decoder (`models/olmo2.py`) takes no input embeddings; the rest of its layer
stack is the generic one (its attention goes through scaled_dot_product_attention)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("olmo2",)
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # LlamaModel.__call__ in olmo2.py
