"""vLLM KV-cache specs from a model's layer kinds.

Full-attention layers get `FullAttentionSpec`; sliding-window layers get `SlidingWindowSpec`, so
vLLM's KV manager frees the blocks that fall out of the window instead of keeping the whole
context; latent-attention (MLA) layers get an `MLAAttentionSpec` (one latent row per token, no
separate values: `kv.latent`); state layers get a `MambaSpec` (`kv.state`). Layers of one kind
form one KV-cache group on vLLM's side. A layer may have its own KV heads and head size
(`LayerKind.num_kv_heads / head_dim`): vLLM then unifies the groups' page sizes by giving the
groups of smaller rows more tokens per block, and the pool reads each layer's pages in its shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.config import CacheConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from vllm_metal.kv import quant, turboquant
from vllm_metal.kv.state import mamba_spec
from vllm_metal.models.layers import LayerKind, memory_layers


def attention_spec(
    kind: LayerKind,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_config: CacheConfig | None = None,
) -> KVCacheSpec:
    if kind.is_state:
        if kind.state is None or cache_config is None:
            raise ValueError("a state layer needs its shapes and vLLM's cache config")
        return mamba_spec(kind.state, dtype, cache_config)
    if kind.latent:
        # One KV head whose head size is the latent row's width: the layer's own shape where it
        # declares one (vLLM's MLA config gives the same for DeepSeek; MiniCPM3 it sizes as
        # plain attention), else vLLM's.
        num_kv_heads, head_dim = kind.kv_shape(num_kv_heads, head_dim)
        return MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_dim,
            dtype=dtype,
            cache_dtype_str=None if cache_config is None else cache_config.cache_dtype,
        )
    num_kv_heads, head_dim = kind.kv_shape(num_kv_heads, head_dim)
    storage = {"dtype": dtype}
    if cache_config is not None and quant.requested(cache_config.cache_dtype):
        # A quantized cache, declared as vLLM's own attention layers declare it.
        storage = quant.spec_storage(cache_config.cache_dtype, head_dim)
    if kind.sliding_window is not None:
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_dim,
            sliding_window=kind.sliding_window,
            **storage,
        )
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_dim, **storage
    )


def kv_cache_specs(
    layer_names: Sequence[str],
    layer_kinds: Sequence[LayerKind],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    cache_config: CacheConfig | None = None,
    first_layer_index: int = 0,
) -> dict[str, KVCacheSpec]:
    """One spec per attention (or state) layer with KV memory, keyed by the layer's real module
    name; a layer reading another's K/V (`LayerKind.kv_source`) has none. `first_layer_index`:
    the index vLLM reads from the first layer's module name (a TurboQuant skip list names layers
    by it; an EAGLE-3 head's layers are numbered after the target's)."""
    if len(layer_names) != len(layer_kinds):
        raise ValueError(f"{len(layer_names)} layer names for {len(layer_kinds)} layer kinds")
    return {
        name: turboquant.layer_spec(
            attention_spec(kind, block_size, num_kv_heads, head_dim, dtype, cache_config),
            first_layer_index + index,
            kind,
            cache_config,
        )
        for index, (name, kind) in enumerate(zip(layer_names, layer_kinds))
        if kind.kv_source is None
    }


def memory_layer_names(layer_names: Sequence[str], layer_kinds: Sequence[LayerKind]) -> list[str]:
    """Per layer, the name of the layer whose KV memory it uses (`layers.memory_layers`)."""
    return [layer_names[i] for i in memory_layers(layer_kinds)]
