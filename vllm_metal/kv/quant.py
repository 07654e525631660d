"""Quantized KV caches. fp8 (``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``): the pools
hold one byte per element (`ops.fp8`) and every attention layer has a key and a value scale.
Per-token-head (``int8_per_token_head`` / ``fp8_per_token_head`` / ``int4_per_token_head``,
`ops.per_token_head`): every stored (token, KV head) row carries its own scale in its page.

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
from vllm_metal.ops import fp8, per_token_head
from vllm_metal.ops.per_token_head import PerTokenHeadQuant

# What the pool holds per element of an fp8 cache, as vLLM sizes it (one byte).
STORAGE_DTYPE = torch.uint8
# vLLM's element dtype of each per-token-head cache (`STR_DTYPE_TO_TORCH_DTYPE`).
PER_TOKEN_HEAD_DTYPES = {
    "int8_per_token_head": torch.int8,
    "fp8_per_token_head": torch.uint8,
    "int4_per_token_head": torch.uint8,
}
_SCALE_NAME = re.compile(r"layers\.(\d+)\..*?(k_scale|v_scale|kv_scale)$")
_LAYER_NUMBER = re.compile(r"layers\.(\d+)(?:\.|$)")


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


@dataclass(frozen=True)
class PerTokenHeadCache:
    """A per-token-head cache: every layer writes and reads its pages the same way."""

    kv_cache_dtype: str

    def layer_reads(self, kinds: Sequence[LayerKind]) -> list[PerTokenHeadQuant]:
        return [PerTokenHeadQuant(self.kv_cache_dtype) for _ in memory_layers(kinds)]


def requested(cache_dtype: str | None) -> bool:
    """Whether vLLM's cache_dtype asks for a quantized cache this module builds."""
    return fp8.format_of(str(cache_dtype)) is not None or per_token_head.is_per_token_head(
        cache_dtype
    )


def spec_storage(cache_dtype: str, head_size: int) -> dict[str, object]:
    """The storage fields of an attention layer's vLLM spec for a quantized cache: what vLLM's
    own attention layers declare (the element dtype and `kv_quant_mode`; a per-token-head cache
    also its content bytes per head slot, K and V with one float32 scale each, as
    `TritonAttentionBackend.customize_spec` packs them), so vLLM sizes the pages the pool lays
    out."""
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    mode = get_kv_quant_mode(cache_dtype)
    if not per_token_head.is_per_token_head(cache_dtype):
        return {"dtype": STORAGE_DTYPE, "kv_quant_mode": mode}
    return {
        "dtype": PER_TOKEN_HEAD_DTYPES[cache_dtype],
        "kv_quant_mode": mode,
        "state_content_bytes": 2 * per_token_head.row_bytes(cache_dtype, head_size),
    }


def draft_cache_config(vllm_config):
    """The cache config a drafter with KV of its own keeps its pages by, as vLLM 0.32 builds the
    draft's (`_create_draft_vllm_config`): the target's, with the speculative config's
    `kv_cache_dtype` where it sets one (the draft inherits `--kv-cache-dtype` otherwise)."""
    from dataclasses import replace

    spec = vllm_config.speculative_config
    override = None if spec is None else getattr(spec, "kv_cache_dtype", None)
    if override is None:
        return vllm_config.cache_config
    return replace(vllm_config.cache_config, cache_dtype=override)


def kv_cache_quant(
    cache_dtype: str | None,
    num_layers: int,
    checkpoint: str | Path | None = None,
    layer_names: Sequence[str] | None = None,
) -> KVCacheQuant | PerTokenHeadCache | None:
    """The quantized cache of a model of `num_layers` layers with KV memory: fp8 with its scales
    from `checkpoint` (a directory of safetensors files) where it has them, or a per-token-head
    cache; None for an unquantized cache. The checkpoint names a scale by decoder layer; layer i
    takes the scales of the decoder layer its module name `layer_names[i]` holds (a hybrid's
    layers with KV memory are not its decoder layers one for one: Nemotron-H's MLP-only blocks
    have none, Falcon-H1's have two), of decoder layer i without names."""
    if per_token_head.is_per_token_head(cache_dtype):
        return PerTokenHeadCache(str(cache_dtype))
    if not requested(cache_dtype):
        return None
    decoder_layers = list(range(num_layers))
    if layer_names is not None:
        decoder_layers = [decoder_layer(name) for name in layer_names]
    scales: dict[int, dict[str, float]] = {}
    for layer, name, value in checkpoint_scales(Path(checkpoint)) if checkpoint else ():
        scales.setdefault(layer, {})[name] = value
    k_scales, v_scales = [], []
    for layer in decoder_layers:
        found = scales.get(layer, {})
        k_scales.append(found.get("k_scale", found.get("kv_scale", 1.0)))
        v_scales.append(found.get("v_scale", found.get("kv_scale", 1.0)))
    return KVCacheQuant(str(cache_dtype), tuple(k_scales), tuple(v_scales))


def decoder_layer(module_name: str) -> int:
    """The decoder layer a module name holds (``...layers.N...``)."""
    match = _LAYER_NUMBER.search(module_name)
    if match is None:
        raise ValueError(f"{module_name!r} names no decoder layer (layers.N)")
    return int(match.group(1))


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
