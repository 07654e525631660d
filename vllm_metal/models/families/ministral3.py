"""Ministral 3 and the language model of Mistral 3 checkpoints built on it (Mistral Small 3.2,
Devstral Small 2, Ministral 3: `ministral3`): a Llama-style stack with YaRN RoPE whose queries are
scaled by position (Llama 4's attention scaling: `1 + beta * log(1 + floor(position /
original_max_position_embeddings))`). mlx-lm's decoder computes that scale from the token ids'
length and the first cache's offset, which the packed step has neither of (its rows are single
tokens at their own positions), so `forward` computes it from each row's position and runs the
layers. Mirrors mlx-lm 0.32.2 (`models/ministral3.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("ministral3",)
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        rope = self.decoder.args.rope_parameters
        scale = _get_llama_4_attn_scale(
            1,
            caches[0].offset,  # [T]: each packed row's position
            rope["llama_4_scaling_beta"],
            rope["original_max_position_embeddings"],
        ).astype(input_embeds.dtype)  # [T, 1, 1, 1]
        h = input_embeds
        for layer, cache in zip(self.decoder.layers, caches):
            h = layer(h, scale, None, cache=cache)
        return self.decoder.norm(h)
