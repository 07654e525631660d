"""Pure-MLX reference of reshape_and_cache (the contract: vllm_metal.ops.cache).

Written to be obviously correct rather than fast: the test oracle for the native op and the
fallback when the extension is not built. Reads slot_mapping on the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
) -> tuple[mx.array, mx.array]:
    """vllm_metal.ops.reshape_and_cache on validated arguments, as a scatter into flattened pools.
    Returns new pool arrays; the inputs are left unchanged."""
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_slots = num_blocks * block_size
    slots = np.asarray(slot_mapping).astype(np.int64)
    rows = np.nonzero((slots >= 0) & (slots < num_slots))[0]
    if rows.size == 0:
        return key_cache, value_cache
    target = mx.array(slots[rows])
    source = mx.array(rows)
    flat_k = key_cache.reshape(num_slots, num_kv_heads, head_size)
    flat_v = value_cache.reshape(num_slots, num_kv_heads, head_size)
    flat_k[target] = key[source]
    flat_v[target] = value[source]
    return flat_k.reshape(key_cache.shape), flat_v.reshape(value_cache.shape)
