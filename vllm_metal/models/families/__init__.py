"""Adapters for the families whose mlx-lm class needs more than the generic adapter, keyed by
`model_type` (one small module each)."""

from __future__ import annotations

import importlib

from vllm_metal.models.adapter import ModelAdapter

# model_type -> module in this package defining `Adapter`
FAMILIES = {
    "deepseek_v3": "deepseek_v3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gpt_oss": "gpt_oss",
    "granitemoehybrid": "granitemoehybrid",
    "idefics3": "idefics3",
    "mistral": "mistral",
    "olmo2": "olmo2",
    "qwen2_moe": "qwen2_moe",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_next": "qwen3_next",
    "qwen3_vl": "qwen3_vl",
}


def adapter_class(model_type: str | None) -> type[ModelAdapter]:
    name = FAMILIES.get(model_type or "")
    if name is None:
        return ModelAdapter
    return importlib.import_module(f"{__name__}.{name}").Adapter


# model_type -> module in this package defining `sanitize(weights) -> weights`, run on the
# checkpoint's tensors before mlx-lm's own `sanitize` (layouts mlx-lm does not read).
SANITIZERS = {
    "gpt_oss": "gpt_oss",
}


def with_sanitizers(get_classes):
    """mlx-lm's class lookup (`get_model_classes` of `load_model`), returning for the families of
    `SANITIZERS` a subclass whose `sanitize` runs the family's before mlx-lm's."""

    def get(config: dict) -> tuple[type, type]:
        model_class, args_class = get_classes(config)
        name = SANITIZERS.get(config.get("model_type") or "")
        if name is None:
            return model_class, args_class
        family_sanitize = importlib.import_module(f"{__name__}.{name}").sanitize

        class Sanitized(model_class):
            def sanitize(self, weights):
                weights = family_sanitize(weights)
                return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

        # The module stays mlx-lm's: attention routing patches the module that defines the class.
        Sanitized.__name__ = Sanitized.__qualname__ = model_class.__name__
        Sanitized.__module__ = model_class.__module__
        return Sanitized, args_class

    return get
