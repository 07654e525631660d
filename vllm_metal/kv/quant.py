"""fp8 KV caches (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``): the pools hold one byte
per element (`ops.fp8`) and every attention layer has a key and a value scale.

The scales follow vLLM 0.32's per-tensor FP8 KV cache: one ``k_scale`` and one ``v_scale`` per
attention layer, loaded from the checkpoint where it carries them (``...layers.N...k_scale`` /
``v_scale``, or one ``kv_scale`` for both), 1.0 otherwise (vLLM's default,
``set_default_quant_scales``). A layer reading another's K/V (`LayerKind.kv_source`) reads them
with the writer's scales.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_metal.models.layers import LayerKind, memory_layers
from vllm_metal.ops import fp8

# What the pool holds per element of an fp8 cache, as vLLM sizes it (one byte).
STORAGE_DTYPE = torch.uint8
_SCALE_NAME = re.compile(r"layers\.(\d+)\..*?(k_scale|v_scale|kv_scale)$")


@dataclass(frozen=True)
class KVCacheQuant:
    """An fp8 cache: its kv_cache_dtype and the (k_scale, v_scale) of every layer (model order)."""

    kv_cache_dtype: str
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]

    def layer_reads(self, kinds: Sequence[LayerKind]) -> list[fp8.KVQuant]:
        """How each layer of `kinds` writes and reads its pages (a reader: its writer's scales)."""
        fmt = fp8.format_of(self.kv_cache_dtype)
        assert fmt is not None
        return [fp8.KVQuant(fmt, self.k_scales[m], self.v_scales[m]) for m in memory_layers(kinds)]


def requested(cache_dtype: str | None) -> bool:
    """Whether vLLM's cache_dtype asks for an fp8 cache this module builds."""
    return fp8.format_of(str(cache_dtype)) is not None


def kv_cache_quant(
    cache_dtype: str | None, num_layers: int, checkpoint: str | Path | None = None
) -> KVCacheQuant | None:
    """The fp8 cache of a model of `num_layers` layers, its scales from `checkpoint` (a directory
    of safetensors files) where it has them; None for an unquantized cache."""
    if not requested(cache_dtype):
        return None
    k_scales, v_scales = [1.0] * num_layers, [1.0] * num_layers
    if checkpoint is not None:
        for layer, name, value in checkpoint_scales(Path(checkpoint)):
            if layer >= num_layers:
                continue
            if name in ("k_scale", "kv_scale"):
                k_scales[layer] = value
            if name in ("v_scale", "kv_scale"):
                v_scales[layer] = value
    return KVCacheQuant(str(cache_dtype), tuple(k_scales), tuple(v_scales))


def checkpoint_scales(directory: Path) -> list[tuple[int, str, float]]:
    """(layer, k_scale / v_scale / kv_scale, value) of every KV scale in a checkpoint's
    safetensors files (a scalar, or the largest of a per-head vector: one scale per layer)."""
    from safetensors import safe_open

    found = []
    for path in sorted(directory.glob("*.safetensors")) if directory.is_dir() else []:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                match = _SCALE_NAME.search(key)
                if match is None:
                    continue
                value = float(f.get_tensor(key).astype("float64").max())
                if not value > 0 or value == float("inf"):
                    raise ValueError(f"{path.name}: {key} = {value} is not a usable KV scale")
                found.append((int(match.group(1)), match.group(2), value))
    return found
