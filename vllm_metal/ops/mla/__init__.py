"""mla_attention and mla_reshape_and_cache: multi-head latent attention (DeepSeek-V2/V3, Kimi K2,
MiniCPM3) over one paged latent cache per layer, and the write of a step's latent rows into it.

Defined (docstrings) and validated here once; implemented by reference.py, by csrc/ops/mla/ on the
CPU and by metal_kernels/mla/ on the GPU.
"""

from __future__ import annotations

from numbers import Integral

import mlx.core as mx

from vllm_metal.ops import _backend
from vllm_metal.ops import _validate as v
from vllm_metal.ops.attention import check_paged_attention_values, uniform_rows
from vllm_metal.ops.cache import check_reshape_and_cache_values
from vllm_metal.ops.cache.batched import scatter_rows
from vllm_metal.ops.mla import batched, reference


def mla_attention(
    query: mx.array,
    latent_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    value_dim: int,
    max_query_len: int | None = None,
) -> mx.array:
    """Varlen causal attention of packed, absorbed queries ``[T, H, D]`` over a paged latent cache.

    ``D = kv_lora_rank + rope_dim`` (576 for DeepSeek-V2/V3 and Kimi K2): each query head is its
    nope part multiplied into the latent space, then its rotary part. ``latent_cache`` is
    ``[num_blocks, block_size, D]``, one latent row per token (its compressed KV, then its rotary
    key); key position ``k`` of sequence ``s`` lives in block ``block_tables[s][k // block_size]``
    at offset ``k % block_size``. ``cu_seqlens_q [S+1]``, ``seq_lens [S]`` (context length after
    this step's tokens) and ``block_tables [S, max_blocks]`` are int32. Query row ``i`` of
    sequence ``s`` (token ``cu_seqlens_q[s] + i``) sits at position ``p = seq_lens[s] - q_len[s]
    + i`` and attends to key positions ``0 .. p``. Every head reads the same rows: the logit of
    head ``h`` and row ``r`` is ``scale * dot(query[t, h], r)`` over all ``D`` columns, and its
    value is ``r[:value_dim]`` (``1 <= value_dim <= D``). Math and softmax are float32; the result
    ``[T, H, value_dim]`` has the query's dtype. Tokens outside every sequence get zeros. Floating
    inputs share one dtype of ``ops.FLOAT_DTYPES``; block sizes are multiples of
    ``ops.BLOCK_SIZE_MULTIPLE``. Any sizes work: the Metal kernel is built for the
    ``(D, value_dim)`` pairs of ``ops.MLA_SIZES``, and on the GPU other sizes run the reference
    (the C++ CPU body takes any).

    ``max_query_len=m`` with ``m * S`` query rows states that every sequence has exactly ``m``,
    as for ``ops.paged_attention``: without native kernels the op then runs one batched graph
    (`batched`) that reads nothing on the host, so it can be traced by ``mx.compile``.
    """
    arrays = (query, latent_cache, block_tables, seq_lens, cu_seqlens_q)
    check_mla_attention(*arrays, scale, value_dim)
    uniform = uniform_rows(max_query_len, query, block_tables, None)
    if _backend.value_checks() and uniform is None:
        check_paged_attention_values(
            query, latent_cache, None, block_tables, seq_lens, cu_seqlens_q
        )
    impl = _backend.native_for((query.shape[2], value_dim), sizes="MLA_SIZES")
    if impl is None and uniform is not None:
        return batched.mla_attention(
            query, latent_cache, block_tables, seq_lens, scale=scale, value_dim=value_dim,
            rows=uniform,
        )  # fmt: skip
    return (impl or reference).mla_attention(*arrays, scale=scale, value_dim=value_dim)


def mla_reshape_and_cache(
    latent: mx.array, latent_cache: mx.array, slot_mapping: mx.array, padded: bool = True
) -> mx.array:
    """Writes latent rows ``[T, D]`` into the paged latent cache at ``slot_mapping`` (int64).

    ``latent_cache`` is ``[num_blocks, block_size, D]``; row ``t`` goes to slot
    ``slot_mapping[t] = block_id * block_size + offset``; a negative slot is padding and skipped
    (so is a slot past the cache's end). Rows and cache share one dtype of ``ops.FLOAT_DTYPES``.
    Returns the updated cache: rebind your reference to it. The native op writes in place, so the
    returned array shares the input's memory. ``padded=False`` states that every slot is in
    range, as for ``ops.reshape_and_cache``: without native kernels the write is then one
    scatter that reads nothing on the host (traceable by ``mx.compile``).
    """
    check_mla_reshape_and_cache(latent, latent_cache, slot_mapping)
    if _backend.value_checks() and padded:
        check_reshape_and_cache_values(latent_cache, slot_mapping)
    native = _backend.native()
    if native is not None:
        return native.mla_reshape_and_cache(latent, latent_cache, slot_mapping)
    if not padded:
        return scatter_rows(latent_cache, latent, slot_mapping)
    return reference.mla_reshape_and_cache(latent, latent_cache, slot_mapping)


def check_mla_attention(
    query: object,
    latent_cache: object,
    block_tables: object,
    seq_lens: object,
    cu_seqlens_q: object,
    scale: object,
    value_dim: object,
) -> None:
    """Raises ValueError (naming the argument) unless the shapes, dtypes and options fit."""
    q_shape = v.shape("query", query, 3, "[num_tokens, num_heads, latent_dim]")
    v.float_dtype("query", query)
    v.head_size("query", q_shape[2])
    latent_dim = v.latent_pool("latent_cache", latent_cache)[2]
    v.same_dtype("latent_cache", latent_cache, "query", query)
    if latent_dim != q_shape[2]:
        v.fail(f"latent_cache latent_dim {latent_dim} differs from query latent_dim {q_shape[2]}")
    v.batch_tables(block_tables, seq_lens, cu_seqlens_q)
    v.scale(scale)
    if (
        isinstance(value_dim, bool)
        or not isinstance(value_dim, Integral)
        or not 1 <= value_dim <= q_shape[2]
    ):
        v.fail(f"value_dim must be an int in 1..latent_dim ({q_shape[2]}), got {value_dim!r}")


def check_mla_reshape_and_cache(latent: object, latent_cache: object, slot_mapping: object) -> None:
    """Raises ValueError (naming the argument) unless the shapes and dtypes fit together."""
    num_tokens, dim = v.shape("latent", latent, 2, "[num_tokens, latent_dim]")
    latent_dim = v.latent_pool("latent_cache", latent_cache)[2]
    if dim != latent_dim:
        v.fail(f"latent latent_dim {dim} differs from latent_cache latent_dim {latent_dim}")
    v.same_dtype("latent", latent, "latent_cache", latent_cache)
    v.index("slot_mapping", slot_mapping, mx.int64, num_tokens, "[num_tokens]")
