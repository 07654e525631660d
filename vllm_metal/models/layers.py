"""What kind of memory each decoder layer needs: full attention, a sliding window, or a state.

Adapters report one `LayerKind` per layer; `vllm_metal.kv` turns them into vLLM KV-cache specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerKind:
    sliding_window: int | None = None  # attends to the last W keys (None = the whole context)
    is_state: bool = False  # recurrent state instead of a KV cache (Mamba, Gated DeltaNet)

    @property
    def label(self) -> str:
        if self.is_state:
            return "state"
        return "full" if self.sliding_window is None else f"sliding({self.sliding_window})"


FULL_ATTENTION = LayerKind()
STATE = LayerKind(is_state=True)


def kinds_from_caches(caches: list[Any]) -> list[LayerKind]:
    """Layer kinds from mlx-lm's own `make_cache()` declaration of a model."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kinds = []
    for cache in caches:
        if isinstance(cache, RotatingKVCache) and not cache.keep:
            kinds.append(LayerKind(sliding_window=int(cache.max_size)))
        elif type(cache) is KVCache:
            kinds.append(FULL_ATTENTION)
        else:
            kinds.append(STATE)
    return kinds


def kinds_from_config(config: Mapping[str, Any], num_layers: int) -> list[LayerKind]:
    """Layer kinds as transformers applies a checkpoint's `sliding_window` / `layer_types`.

    For families whose mlx-lm class does not declare its windows through `make_cache()`.
    """
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if not window:
        return [FULL_ATTENTION] * num_layers
    sliding = LayerKind(sliding_window=int(window))
    if layer_types:
        kinds = [sliding if t == "sliding_attention" else FULL_ATTENTION for t in layer_types]
        return kinds[:num_layers]
    if config.get("use_sliding_window", True) is False:
        return [FULL_ATTENTION] * num_layers
    return [sliding] * num_layers
