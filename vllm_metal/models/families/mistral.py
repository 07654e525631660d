"""Mistral: mlx-lm serves it with its Llama class, which applies a sliding window only when the
config lists `layer_types`; transformers and vLLM apply the checkpoint's `sliding_window` to
every layer, so the windows come from the config. Mirrors mlx-lm 0.32.2 (`models/llama.py`)."""

from __future__ import annotations

from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LayerKind, kinds_from_config

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("mistral",)
KIND = "text"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def layer_kinds(self) -> list[LayerKind]:
        return kinds_from_config(self.config, self.num_layers)
