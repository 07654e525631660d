"""Per-architecture adapters for mlx-lm models whose attention does not go through mlx-lm's
`scaled_dot_product_attention` (one small module per family)."""

from __future__ import annotations

import importlib
from types import ModuleType

# mlx-lm module name -> adapter module in this package
ADAPTERS = {"mlx_lm.models.gemma2": "gemma2"}


def adapter_for(module: ModuleType) -> ModuleType | None:
    name = ADAPTERS.get(module.__name__)
    return importlib.import_module(f"{__name__}.{name}") if name else None
