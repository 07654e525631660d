"""OLMo 2 and OLMo 3: mlx-lm's decoders (`models/olmo2.py`, `models/olmo3.py`) take no input
embeddings; the rest of their layer stacks is the generic one (attention through
scaled_dot_product_attention; OLMo 3's sliding layers are read from its `make_cache()`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("olmo2", "olmo3")
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # __call__ minus embed_tokens
