"""Decoders whose mlx-lm class takes no input embeddings and is otherwise the generic layer stack:
its `__call__` embeds the tokens, runs the layers and the final norm, nothing else (read in mlx-lm
0.32.2's `models/olmo2.py`, `olmo3.py`, `hunyuan_v1_dense.py`, `seed_oss.py`, `glm4.py`,
`ernie4_5.py`), attention goes through `scaled_dot_product_attention`, and OLMo 3's sliding layers
are read from its `make_cache()`. The runner embeds the tokens and runs the layers itself
(`decode_layers`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("olmo2", "olmo3", "hunyuan_v1_dense", "seed_oss", "glm4", "ernie4_5")
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # __call__ minus embed_tokens
