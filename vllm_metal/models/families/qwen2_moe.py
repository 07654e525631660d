"""Qwen2-MoE (Qwen1.5-MoE): routed experts plus a shared expert behind a sigmoid gate. mlx-lm's
decoder takes no input embeddings, and its sparse block always applies every layer's experts
without renormalising the top-k weights. Mirrors mlx-lm 0.32.2 (`models/qwen2_moe.py`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("qwen2_moe",)
KIND = "moe"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def __init__(self, model: Any, config: dict[str, Any]):
        # Settings transformers honours and mlx-lm's Qwen2-MoE ignores. Dense layers among the
        # sparse ones already fail mlx-lm's strict weight load; renormalised top-k weights would
        # load and silently differ.
        if config.get("norm_topk_prob"):
            raise ValueError(
                "qwen2_moe with norm_topk_prob=true is not supported: mlx-lm's Qwen2-MoE does not "
                "renormalise the top-k routing weights"
            )
        super().__init__(model, config)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # Qwen2MoeModel.__call__
