"""Pure-MLX reference of reshape_and_cache (the contract: vllm_metal.ops.cache).

Written to be obviously correct rather than fast: the test oracle for the native op and the
fallback when the extension is not built. Reads slot_mapping on the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.ops.fp8 import KVQuant, quantize


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
    quant: KVQuant | None = None,
) -> tuple[mx.array, mx.array]:
    """vllm_metal.ops.reshape_and_cache on validated arguments, as a scatter into flattened pools.
    Returns new pool arrays; the inputs are left unchanged. ``quant``: uint8 pools, rows stored
    as fp8 bytes with its scales."""
    if quant is not None:
        key, value = (
            quantize(key, quant.fmt, quant.k_scale),
            quantize(value, quant.fmt, quant.v_scale),
        )
    return write_rows(key_cache, key, slot_mapping), write_rows(value_cache, value, slot_mapping)


def write_rows(pool: mx.array, rows: mx.array, slot_mapping: mx.array) -> mx.array:
    """``pool`` (``[num_blocks, block_size, ...]``) with token row ``t`` of ``rows`` written at
    slot ``slot_mapping[t]``, negative or out-of-range slots skipped. A new array; the input is
    left unchanged."""
    num_slots = pool.shape[0] * pool.shape[1]
    slots = np.asarray(slot_mapping).astype(np.int64)
    valid = np.nonzero((slots >= 0) & (slots < num_slots))[0]
    if valid.size == 0:
        return pool
    flat = pool.reshape(num_slots, *pool.shape[2:])
    flat[mx.array(slots[valid])] = rows[mx.array(valid)]
    return flat.reshape(pool.shape)
