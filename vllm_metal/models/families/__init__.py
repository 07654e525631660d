"""Adapters for the families whose mlx-lm class needs more than the generic adapter, keyed by
`model_type` (one small module each). Each family module declares what it is to the capability
table: its `MODEL_TYPES`, its `KIND` and the `MODALITIES` its towers encode (`declarations`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

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


# Modules of this package whose families are served by another adapter than `Adapter`: the
# encoder-only (`models/encoder.py`) and speech-to-text (`WhisperAdapter`) ones.
OTHER_FAMILIES = ("bert", "whisper", "xlm_roberta")


@dataclass(frozen=True)
class Declaration:
    """What a `model_type` is to the capability table (`vllm_metal.config.kinds`)."""

    model_type: str
    kind: str
    modalities: tuple[str, ...] = ()


# The architectures served without a module here that the capability table must still tell
# apart: LFM2's short convolutions run in vLLM's own model class on the torch backend
# (`backends/torch/short_conv.py`). Any other mlx-lm architecture is a plain text decoder.
WITHOUT_ADAPTER = (Declaration("lfm2", "short_conv_hybrid"),)


@cache
def declarations() -> dict[str, Declaration]:
    """model_type -> its declaration, from every family module and `WITHOUT_ADAPTER`."""
    found = {d.model_type: d for d in WITHOUT_ADAPTER}
    for name in sorted({*FAMILIES.values(), *OTHER_FAMILIES}):
        module = importlib.import_module(f"{__name__}.{name}")
        for model_type in module.MODEL_TYPES:
            found[model_type] = Declaration(model_type, module.KIND, module.MODALITIES)
    return found


def model_types(kind: str) -> tuple[str, ...]:
    """The model types declared as `kind`, sorted."""
    return tuple(sorted(t for t, d in declarations().items() if d.kind == kind))


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
