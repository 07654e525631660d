"""reshape_and_cache, which scatters a step's key/value rows into the paged KV pools.

Defined (docstring) and validated here once; implemented by csrc/ops/cache/ on the CPU, by
metal_kernels/cache/ on a Metal GPU and by batched.py elsewhere; reference.py is its oracle.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _backend, fp8, per_token_head
from vllm_metal.ops import _validate as v
from vllm_metal.ops.cache import batched

_PASSED: set = set()  # argument signatures that passed check_reshape_and_cache


def reshape_and_cache(
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    padded: bool = True,
) -> tuple[mx.array, mx.array]:
    """Writes key/value rows ``[T, Hkv, D]`` into the paged pools at ``slot_mapping`` (int64).

    Pools are ``[num_blocks, block_size, Hkv, D]``; row ``t`` goes to slot ``slot_mapping[t] =
    block_id * block_size + offset``; a negative slot is padding and skipped (so is a slot past
    the pools' end). Rows and pools share one dtype of ``ops.FLOAT_DTYPES``. Returns the updated
    pools: rebind your references to them. The native op writes in place, so the returned arrays
    share the inputs' memory.

    ``kv_cache_dtype`` ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (`ops.fp8`): the pools are
    ``uint8`` and hold ``fp8(key / k_scale)`` and ``fp8(value / v_scale)`` (rows of any float
    dtype); ``"auto"``: the pools hold the rows as they are. The native op (C++ CPU body, Metal
    kernel) quantizes as it writes.

    ``"int8_per_token_head"`` / ``"fp8_per_token_head"`` / ``"int4_per_token_head"``
    (`ops.per_token_head`): the pools are ``uint8 [num_blocks, block_size, Hkv, row_bytes]`` and
    each row is stored with its own scale, by vLLM's rules. The native op writes all three (int4:
    the rows rotated in MLX first, the op quantizing and packing them).
    """
    arrays = (key, value, key_cache, value_cache, slot_mapping)
    options = (kv_cache_dtype, k_scale, v_scale)
    v.once(_PASSED, (*arrays, *options), check_reshape_and_cache)
    if _backend.value_checks() and padded:
        check_reshape_and_cache_values(key_cache, slot_mapping)
    per_row = per_token_head.kv_quant(kv_cache_dtype)
    native = _native_writer(key.shape[2], kv_cache_dtype)
    if per_row is not None:
        if native is not None:
            key, value = per_row.stored_rows(key), per_row.stored_rows(value)
            return native.reshape_and_cache(key, value, *arrays[2:], quant=per_row)
        key, value = per_row.quantize(key), per_row.quantize(value)
        return batched.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, padded)
    quant = fp8.kv_quant(*options)
    if native is not None:
        return native.reshape_and_cache(*arrays, quant=quant)
    if quant is not None:
        key, value = fp8.quantize(key, quant.fmt, k_scale), fp8.quantize(value, quant.fmt, v_scale)
    return batched.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, padded)


def writes_in_place(head_size: int, kv_cache_dtype: str = "auto") -> bool:
    """Whether `reshape_and_cache` of rows `head_size` wide in that format runs the native op,
    which writes into the pools' memory (a view of a region included); the MLX one returns new
    arrays."""
    return _native_writer(head_size, kv_cache_dtype) is not None


def _native_writer(head_size: int, kv_cache_dtype: str):
    """The native module that writes rows `head_size` wide in that format, or None (MLX's ops)."""
    per_row = per_token_head.kv_quant(kv_cache_dtype)
    native = _backend.native_for(head_size)
    return native if per_row is None or per_row.native else None


def check_reshape_and_cache(
    key: object,
    value: object,
    key_cache: object,
    value_cache: object,
    slot_mapping: object,
    kv_cache_dtype: object = "auto",
    k_scale: object = 1.0,
    v_scale: object = 1.0,
) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    k_shape = v.shape("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    if tuple(v.array("value", value).shape) != k_shape:
        v.fail(f"value shape {tuple(value.shape)} differs from key shape {k_shape}")
    quantized = v.kv_cache_dtype(kv_cache_dtype, k_scale, v_scale)
    _, _, num_kv_heads, width = v.pools(key_cache, value_cache, quantized)
    if k_shape[1] != num_kv_heads:
        v.fail(
            f"key rows num_kv_heads = {k_shape[1]} do not match key_cache num_kv_heads = "
            f"{num_kv_heads}"
        )
    v.pool_row(kv_cache_dtype, width, k_shape[2])
    if quantized:
        v.float_dtype("key", key)
        v.same_dtype("value", value, "key", key)
    else:
        v.same_dtype("key", key, "key_cache", key_cache)
        v.same_dtype("value", value, "key_cache", key_cache)
    v.index("slot_mapping", slot_mapping, mx.int64, k_shape[0], "[num_tokens]")


def check_reshape_and_cache_values(key_cache: mx.array, slot_mapping: mx.array) -> None:
    """Raises ValueError when a slot is past the end of the pools (reads slot_mapping)."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = np.asarray(slot_mapping)
    bad = np.nonzero(slots >= num_slots)[0]
    if bad.size:
        t = int(bad[0])
        v.fail(
            f"slot_mapping[{t}] = {int(slots[t])} is out of range for {num_slots} slots "
            f"(num_blocks * block_size)"
        )
