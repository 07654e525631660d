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


def test_a_drafters_layers_are_skipped_by_the_index_vllm_reads_from_their_names() -> None:
    """vLLM numbers an EAGLE-3 head's layer after the target's (`llama_eagle3.py`) and a draft
    model's from 0, and applies the target's skip list to the index in the module name
    (`extract_layer_index`): the head after a six-layer target stores slots, and so does a
    draft model's layer 2, though the skip list names positions 0, 1, 4 and 5."""
    from vllm.model_executor.models.utils import extract_layer_index

    cache = CacheConfig(cache_dtype="turboquant_4bit_nc")
    cache.kv_cache_dtype_skip_layers = SKIPS[0]
    shape = {"block_size": 16, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.float32}
    head = kv_cache_specs(["eagle3.layers.0.self_attn"], [FULL_ATTENTION], **shape,
                          cache_config=cache, first_layer_index=6)  # fmt: skip
    assert extract_layer_index("model.layers.6.self_attn.attn") == 6  # the head's name in vLLM
    assert head["eagle3.layers.0.self_attn"].dtype == torch.uint8
    assert TurboQuantCache.of(cache, [FULL_ATTENTION], 6).quantized == (True,)
    names = [f"draft.model.layers.{i}.self_attn" for i in range(3)]
    kinds = [FULL_ATTENTION] * 3
    draft = kv_cache_specs(names, kinds, **shape, cache_config=cache)
    assert [draft[n].dtype == torch.uint8 for n in names] == [False, False, True]
    assert TurboQuantCache.of(cache, kinds).quantized == (False, False, True)
