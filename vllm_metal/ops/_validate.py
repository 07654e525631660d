"""Argument checks shared by the ops: each raises ValueError naming the argument.

The ops validate here once, before choosing an implementation, so the native path and the
reference path accept exactly the same arguments (the C++ builders do not check again). These
read only metadata, so they never wait for the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Integral, Real

import mlx.core as mx

from vllm_metal.ops._constants import BLOCK_SIZE_MULTIPLE, FLOAT_DTYPES

POOL_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_size]"
LATENT_POOL_LAYOUT = "[num_blocks, block_size, latent_dim]"


_PLAIN = (int, float, bool, str, type(None))
_SIGNATURES_KEPT = 256


def signature(args: tuple[object, ...]) -> tuple[object, ...] | None:
    """What an op's checks read of its arguments: each array's shape and dtype, each plain
    option's type and value; None when an argument is anything else (checked every time)."""
    parts: list[object] = []
    for arg in args:
        if type(arg) is mx.array:
            parts.append((arg.shape, arg.dtype))
        elif type(arg) in _PLAIN:
            parts.append((type(arg), arg))
        else:
            return None
    return tuple(parts)


def once(passed: set, args: tuple[object, ...], check: Callable[..., None]) -> None:
    """``check(*args)`` unless arguments of the same `signature` passed it before: every layer of
    a step calls an op with the same shapes, so its checks run once per step at most."""
    key = signature(args)
    if key is not None and key in passed:
        return
    check(*args)
    if key is not None:
        if len(passed) >= _SIGNATURES_KEPT:
            passed.clear()
        passed.add(key)


def fail(message: str) -> None:
    raise ValueError(message)


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def array(name: str, x: object) -> mx.array:
    if not isinstance(x, mx.array):
        fail(f"{name} must be an mx.array, got {type(x).__name__}")
    return x


def shape(name: str, x: object, ndim: int, layout: str) -> tuple[int, ...]:
    if array(name, x).ndim != ndim:
        fail(f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(x.shape)}")
    return tuple(x.shape)


def float_dtype(name: str, x: mx.array) -> None:
    if x.dtype not in FLOAT_DTYPES:
        names = ", ".join(map(dtype_name, FLOAT_DTYPES))
        fail(f"{name} must be one of {names}, got {dtype_name(x.dtype)}")


def same_dtype(name: str, x: mx.array, ref_name: str, ref: mx.array) -> None:
    if x.dtype != ref.dtype:
        fail(
            f"{name} dtype {dtype_name(x.dtype)} differs from {ref_name} dtype "
            f"{dtype_name(ref.dtype)}"
        )


def index(name: str, x: object, dtype: mx.Dtype, length: int, layout: str) -> None:
    shape(name, x, 1, layout)
    if x.dtype != dtype:
        fail(f"{name} must be {dtype_name(dtype)}, got {dtype_name(x.dtype)}")
    if x.shape[0] != length:
        fail(f"{name} must have shape {layout} = ({length},), got shape {tuple(x.shape)}")


def head_size(name: str, size: int) -> None:
    # Any size runs: the Metal kernels exist for HEAD_SIZES, other sizes take the generic path
    # (_backend.native_for).
    if size <= 0:
        fail(f"{name} head_size must be positive, got {size}")


def block_size(name: str, size: int) -> None:
    if size <= 0 or size % BLOCK_SIZE_MULTIPLE:
        fail(f"{name} block_size must be a positive multiple of {BLOCK_SIZE_MULTIPLE}, got {size}")


def latent_pool(name: str, cache: object) -> tuple[int, int, int]:
    """Checks a paged latent cache (MLA: one row per token, no heads); returns its shape."""
    pool = shape(name, cache, 3, LATENT_POOL_LAYOUT)
    block_size(name, pool[1])
    if pool[0] <= 0:
        fail(f"{name} must have at least one block, got shape {pool}")
    float_dtype(name, cache)
    head_size(name, pool[2])
    return pool  # type: ignore[return-value]


def kv_cache_dtype(name: object, k_scale: object, v_scale: object) -> bool:
    """Checks the storage options of the paged ops; True when they ask for quantized (uint8)
    pools: fp8 (`ops.fp8`) or per-token-head (`ops.per_token_head`)."""
    from vllm_metal.ops import fp8, per_token_head

    names = ("auto", *fp8.KV_CACHE_DTYPES, *per_token_head.KV_CACHE_DTYPES)
    if not isinstance(name, str) or name not in names:
        choices = ", ".join(repr(n) for n in names)
        fail(f"kv_cache_dtype must be one of {choices}, got {name!r}")
    for arg, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
            fail(f"{arg} must be a finite positive number, got {value!r}")
        if value <= 0:
            fail(f"{arg} must be a finite positive number, got {value!r}")
    return name != "auto"


def pools(
    key_cache: object, value_cache: object, quantized: bool = False
) -> tuple[int, int, int, int]:
    """Checks the K/V pools against each other and the supported sizes; returns their shape.
    ``quantized``: fp8 or per-token-head pools, uint8 (whose last axis is bytes per row)."""
    pool = shape("key_cache", key_cache, 4, POOL_LAYOUT)
    block_size("key_cache", pool[1])
    if pool[0] <= 0 or pool[2] <= 0:
        fail(f"key_cache must have at least one block and one KV head, got shape {pool}")
    if tuple(array("value_cache", value_cache).shape) != pool:
        fail(f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape {pool}")
    if quantized:
        if key_cache.dtype != mx.uint8:
            got = dtype_name(key_cache.dtype)
            fail(f"key_cache of a quantized kv_cache_dtype must be uint8, got {got}")
    else:
        float_dtype("key_cache", key_cache)
    same_dtype("value_cache", value_cache, "key_cache", key_cache)
    head_size("key_cache", pool[3])
    return pool  # type: ignore[return-value]


def pool_row(kv_cache_dtype: str, pool_width: int, head_size: int) -> None:
    """Checks that a pool's rows hold rows of ``head_size`` elements in that storage."""
    from vllm_metal.ops import per_token_head

    if not per_token_head.is_per_token_head(kv_cache_dtype):
        if pool_width != head_size:
            fail(f"key_cache head_size {pool_width} differs from the rows' head_size {head_size}")
        return
    if kv_cache_dtype == "int4_per_token_head" and head_size % 2:
        fail(f"int4_per_token_head needs an even head_size, got {head_size}")
    width = per_token_head.row_bytes(kv_cache_dtype, head_size)
    if pool_width != width:
        fail(
            f"key_cache rows of {kv_cache_dtype} with head_size {head_size} are {width} bytes "
            f"(data and a float32 scale), got {pool_width}"
        )


def batch_tables(block_tables: object, seq_lens: object, cu_seqlens_q: object) -> None:
    """The varlen batch of the attention ops: block tables, context lengths, query offsets."""
    num_seqs = shape("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")[0]
    if block_tables.dtype != mx.int32:
        fail(f"block_tables must be int32, got {dtype_name(block_tables.dtype)}")
    index("seq_lens", seq_lens, mx.int32, num_seqs, "[num_seqs]")
    index("cu_seqlens_q", cu_seqlens_q, mx.int32, num_seqs + 1, "[num_seqs + 1]")


def scale(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        fail(f"scale must be a finite number, got {value!r}")


def rows_per_sequence(max_query_len: object, num_tokens: int, num_seqs: int) -> None:
    """A recurrent op's ``max_query_len``: None, or every sequence's rows (``num_tokens`` of
    them in all)."""
    if max_query_len is None:
        return
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, Integral):
        fail(f"max_query_len must be a positive integer or None, got {max_query_len!r}")
    if max_query_len < 1 or num_tokens != max_query_len * num_seqs:
        fail(
            f"max_query_len={max_query_len} gives {num_seqs} sequences "
            f"{max_query_len * num_seqs} rows; the batch has {num_tokens}"
        )
