"""TurboQuant caches on the KV side: the layers vLLM skips keep the model's dtype, the others are
specified as vLLM's TurboQuant layers declare them, and the pool holds exactly the bytes per block
those specs size (key and value pools of uint8 slots beside float regions)."""

from __future__ import annotations

import mlx.core as mx
import pytest
import torch
from vllm.config import CacheConfig
from vllm.v1.kv_cache_interface import KVQuantMode

from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.kv.spec import kv_cache_specs
from vllm_metal.kv.turboquant import TurboQuantCache, TurboQuantPool
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind

SLIDING = LayerKind(sliding_window=8)
KINDS = [FULL_ATTENTION, SLIDING, FULL_ATTENTION, SLIDING, FULL_ATTENTION, FULL_ATTENTION]
# What vLLM derives for six dense layers (two at each end) and what a user may add.
SKIPS = [["0", "1", "4", "5"], ["0", "1", "4", "5", "sliding_window"]]


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize("dtype", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_pool_holds_the_bytes_vllm_sizes(dtype: str, skip: list[str]) -> None:
    cache = CacheConfig(cache_dtype=dtype)
    cache.kv_cache_dtype_skip_layers = skip
    names = [f"model.layers.{i}.self_attn" for i in range(len(KINDS))]
    specs = kv_cache_specs(names, KINDS, block_size=16, num_kv_heads=2, head_dim=64,
                           dtype=torch.float32, cache_config=cache)  # fmt: skip
    quantized = [i for i, name in enumerate(names) if specs[name].dtype == torch.uint8]
    assert quantized == ([2] if "sliding_window" in skip else [2, 3])
    for i in quantized:
        assert specs[names[i]].kv_quant_mode == KVQuantMode[dtype.upper()]
    layout = KVLayout.single_group(len(KINDS), 4, 16)
    pool = pool_for(layout, KINDS, 2, 64, mx.float32, TurboQuantCache.of(cache, KINDS))
    assert isinstance(pool, TurboQuantPool)
    for i, name in enumerate(names):
        r = layout.region_of_layer[i]
        per_block = (pool.keys[r].nbytes + pool.values[r].nbytes) // layout.num_blocks
        assert per_block == specs[name].page_size_bytes, (i, per_block)
        assert (pool.keys[r].dtype == mx.uint8) == (i in quantized)
    # Block 0 (vLLM's null block) reads as zeros.
    assert all(not mx.any(a[0]).item() for a in pool.arrays())
