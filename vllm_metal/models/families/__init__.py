"""Adapters for the families whose mlx-lm class needs more than the generic adapter, keyed by
`model_type` (one small module each)."""

from __future__ import annotations

import importlib

from vllm_metal.models.adapter import ModelAdapter

# model_type -> module in this package defining `Adapter`
FAMILIES = {
    "gemma2": "gemma2",
    "mistral": "mistral",
}


def adapter_class(model_type: str | None) -> type[ModelAdapter]:
    name = FAMILIES.get(model_type or "")
    if name is None:
        return ModelAdapter
    return importlib.import_module(f"{__name__}.{name}").Adapter
