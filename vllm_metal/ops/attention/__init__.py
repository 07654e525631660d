"""paged_attention, the varlen causal attention of a step's packed queries over paged K/V pools.

Its docstring is the contract, and its checks are the only ones: the reference beside it, the C++
primitive in csrc/ops/attention/ and the Metal families in metal_kernels/attention/ implement it.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _backend, fp8, per_token_head
from vllm_metal.ops import _validate as v
from vllm_metal.ops.attention import batched, cuda, reference

_PASSED: set = set()  # argument signatures that passed check_paged_attention


def paged_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: mx.array | None = None,
    key_ends: np.ndarray | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_query_len: int | None = None,
) -> mx.array:
    """Varlen causal attention of packed queries ``[T, Hq, D]`` over paged K/V pools.

    Pools are ``[num_blocks, block_size, Hkv, D]`` (``Hq`` a multiple of ``Hkv``); key position
    ``k`` of sequence ``s`` lives in block ``block_tables[s][k // block_size]`` at offset
    ``k % block_size``. ``cu_seqlens_q [S+1]``, ``seq_lens [S]`` (context length after this
    step's tokens) and ``block_tables [S, max_blocks]`` are int32. Query row ``i`` of sequence
    ``s`` (token ``cu_seqlens_q[s] + i``) sits at position ``p = seq_lens[s] - q_len[s] + i`` and
    attends to key positions ``max(0, p - sliding_window + 1) .. p`` (``0 .. p`` without a
    window). Query head ``h`` reads KV head ``h // (Hq / Hkv)``. Logits are ``scale * q.k``;
    ``softcap = c`` maps each to ``c * tanh(x / c)``; ``sinks [Hq]`` adds one logit per query
    head with a zero value (it only enlarges the softmax denominator). Math is float32; the
    result has the query's dtype. Floating inputs share one dtype of ``ops.FLOAT_DTYPES``; block
    sizes are multiples of ``ops.BLOCK_SIZE_MULTIPLE``. Any head size works: the Metal kernels
    are built for ``ops.HEAD_SIZES``, and on the GPU another size runs the reference (the C++ CPU
    body takes any size). Tokens outside every sequence get zeros.

    ``key_ends`` (host ``[T]`` integers, optional) lets query rows see ahead of their position, as
    a prefix-LM lets the tokens of one image attend to each other (Gemma 3): row ``i`` at
    position ``p`` attends to ``max(0, p - sliding_window + 1) .. max(p, key_ends[i] - 1)``. Its
    keys must be in the pools already (``key_ends[i] <= seq_lens[s]``). Rows it extends run
    through the reference, the rest through the native op.

    ``kv_cache_dtype`` ``"fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"`` (`ops.fp8`): the pools are
    ``uint8`` fp8 bytes (any float query dtype), and a key reads as ``float(byte) * k_scale``, a
    value as ``float(byte) * v_scale``, rounded to the query's dtype; the rest of the contract is
    unchanged. The native op (C++ CPU body, every Metal kernel family) reads the bytes as it
    attends.

    ``"int8_per_token_head"`` / ``"fp8_per_token_head"`` / ``"int4_per_token_head"``
    (`ops.per_token_head`): the pools hold rows with their own scales, ``uint8 [num_blocks,
    block_size, Hkv, row_bytes]``; a key or value reads as its row's dequantized value, rounded
    to the query's dtype (int4: the query is rotated as the rows were, attends with ``scale /
    b``, and the output is rotated back, `ops.per_token_head`). The native op (C++ CPU body,
    every Metal kernel family) reads the rows as it attends, multiplying each key's score and
    each value's weight by its row's scale (int4: levels from nibbles less the row's zero point,
    the rotations in MLX around it).

    ``max_query_len=m`` with ``m * S`` query rows states that every sequence has exactly ``m``
    (``cu_seqlens_q`` is ``0, m, 2m, ..``, without ``key_ends``): a decode step at ``m = 1``, a
    step verifying ``m - 1`` drafts per sequence above. The op then reads nothing on the host
    while it builds its graph, so it can be traced by ``mx.compile``; ``seq_lens`` and
    ``cu_seqlens_q`` must hold their values (arrays made from host data, not lazy results). Any
    other ``max_query_len`` (the longest sequence's rows, fewer rows in all) changes nothing.
    """
    arrays = (query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q)
    options = (kv_cache_dtype, k_scale, v_scale)
    signature = (*arrays, scale, sliding_window, softcap, sinks, *options)
    v.once(_PASSED, signature, check_paged_attention)
    uniform = uniform_rows(max_query_len, query, block_tables, key_ends)
    if _backend.value_checks() and uniform is None:
        check_paged_attention_values(*arrays)
    per_row = per_token_head.kv_quant(kv_cache_dtype)
    if per_row is not None:
        quant = per_row
        impl = _backend.native_for(query.shape[2]) if per_row.native else None
        impl = impl or batched
        if per_row.rotated:
            dtype = query.dtype
            query = per_token_head.rotate(query).astype(dtype)
            scale = scale / per_token_head.rotation_block(query.shape[2])
            arrays = (query, *arrays[1:])
    else:
        quant = fp8.kv_quant(*options)
        impl = _backend.native_for(query.shape[2]) or batched
    options = {"sliding_window": sliding_window, "softcap": softcap, "sinks": sinks}
    if quant is not None:
        options["quant"] = quant
    out = None
    if (
        impl is batched
        and uniform == 1
        and _backend.cuda_kernels()
        and not (softcap or sinks or quant)
    ):
        out = cuda.decode_attention(*arrays[:5], scale=scale, sliding_window=sliding_window)
    if out is None:
        out = impl.paged_attention(*arrays, scale=scale, uniform=uniform, **options)
    if key_ends is not None:
        ahead = _rows_seeing_ahead(key_ends, cu_seqlens_q, seq_lens, query.shape[0])
        for s, rows, positions in ahead:
            out[mx.array(rows)] = reference.attend_rows(
                query[mx.array(rows)],
                key_cache,
                value_cache,
                block_tables[s],
                int(seq_lens[s].item()),
                positions,
                key_ends[rows],
                scale=scale,
                **options,
            )
    if per_row is not None and per_row.rotated:
        b = per_token_head.rotation_block(query.shape[2])
        out = (per_token_head.rotate(out, inverse=True) / b).astype(query.dtype)
    return out


def uniform_rows(
    max_query_len: object, query: mx.array, block_tables: mx.array, key_ends: object
) -> int | None:
    """The query rows of every sequence where ``max_query_len`` declares them all equal (None
    where it does not); raises ValueError (naming it) when it is malformed or contradicts the
    other arguments."""
    if max_query_len is None:
        return None
    if not isinstance(max_query_len, Integral) or max_query_len < 1:
        v.fail(f"max_query_len must be a positive integer or None, got {max_query_len!r}")
    num_seqs = block_tables.shape[0]
    if query.shape[0] > max_query_len * num_seqs:
        v.fail(
            f"max_query_len={max_query_len} allows at most {max_query_len * num_seqs} query rows "
            f"for {num_seqs} sequences; query has {query.shape[0]}"
        )
    if query.shape[0] < max_query_len * num_seqs:
        return None
    if key_ends is not None:
        v.fail(
            f"max_query_len={max_query_len} with rows of equal length cannot take key_ends "
            "(rows that see ahead belong to a prefill)"
        )
    return int(max_query_len)


def _rows_seeing_ahead(
    key_ends: object, cu_seqlens_q: mx.array, seq_lens: mx.array, num_tokens: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(sequence, packed rows, their positions) of the rows whose key end lies past their own
    position; raises ValueError (naming ``key_ends``) when it is malformed."""
    if not isinstance(key_ends, np.ndarray) or key_ends.shape != (num_tokens,):
        v.fail(f"key_ends must be a host array of shape [num_tokens] = ({num_tokens},)")
    if key_ends.dtype.kind not in "iu":
        v.fail(f"key_ends must hold integers, got {key_ends.dtype}")
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    lens = np.asarray(seq_lens).astype(np.int64)
    ahead = []
    for s, seq_len in enumerate(lens.tolist()):
        start, end = int(cu[s]), int(cu[s + 1])
        positions = np.arange(seq_len - (end - start), seq_len)
        ends = key_ends[start:end]
        if (ends > seq_len).any():
            i = start + int(np.argmax(ends > seq_len))
            v.fail(f"key_ends[{i}] = {int(key_ends[i])} exceeds seq_lens[{s}] = {seq_len}")
        seeing = np.nonzero(ends > positions + 1)[0]
        if seeing.size:
            ahead.append((s, start + seeing, positions[seeing]))
    return ahead


def check_paged_attention(
    query: object,
    key_cache: object,
    value_cache: object,
    block_tables: object,
    seq_lens: object,
    cu_seqlens_q: object,
    scale: object,
    sliding_window: object,
    softcap: object,
    sinks: object,
    kv_cache_dtype: object = "auto",
    k_scale: object = 1.0,
    v_scale: object = 1.0,
) -> None:
    """Raises ValueError (naming the argument) unless the shapes, dtypes and options fit."""
    q_shape = v.shape("query", query, 3, "[num_tokens, num_heads, head_size]")
    v.float_dtype("query", query)
    v.head_size("query", q_shape[2])
    quantized = v.kv_cache_dtype(kv_cache_dtype, k_scale, v_scale)
    _, _, num_kv_heads, width = v.pools(key_cache, value_cache, quantized)
    if not quantized:
        v.same_dtype("key_cache", key_cache, "query", query)
    v.pool_row(kv_cache_dtype, width, q_shape[2])
    if q_shape[1] % num_kv_heads:
        v.fail(
            f"query num_heads ({q_shape[1]}) must be a multiple of key_cache num_kv_heads "
            f"({num_kv_heads})"
        )
    v.batch_tables(block_tables, seq_lens, cu_seqlens_q)

    v.scale(scale)
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, Integral)
        or sliding_window <= 0
    ):
        v.fail(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, Real)
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        v.fail(f"softcap must be a positive number or None (None disables it), got {softcap!r}")
    if sinks is not None:
        v.array("sinks", sinks)
        if tuple(sinks.shape) != (q_shape[1],):
            v.fail(f"sinks must have shape [num_heads] = ({q_shape[1]},), got {tuple(sinks.shape)}")
        v.float_dtype("sinks", sinks)


def check_paged_attention_values(*arrays: mx.array) -> None:
    """Raises ValueError when the index arrays of the op's six (checked) arrays are inconsistent
    with each other or the pools (reads them on the host)."""
    query, key_cache, _, block_tables, seq_lens, cu_seqlens_q = arrays
    num_tokens = query.shape[0]
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    cu = np.asarray(cu_seqlens_q).astype(np.int64)
    lens = np.asarray(seq_lens).astype(np.int64)
    tables = np.asarray(block_tables)
    if cu[0] != 0:
        v.fail(f"cu_seqlens_q[0] must be 0, got {int(cu[0])}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        s = int(np.nonzero(q_lens < 0)[0][0])
        v.fail(f"cu_seqlens_q must be non-decreasing (cu_seqlens_q[{s + 1}] < cu_seqlens_q[{s}])")
    if cu[-1] > num_tokens:
        v.fail(f"cu_seqlens_q[-1] = {int(cu[-1])} exceeds the {num_tokens} query tokens")
    short = np.nonzero(lens < q_lens)[0]
    if short.size:
        s = int(short[0])
        v.fail(f"seq_lens[{s}] = {int(lens[s])} is shorter than its {int(q_lens[s])} query tokens")
    capacity = tables.shape[1] * block_size
    long = np.nonzero(lens > capacity)[0]
    if long.size:
        s = int(long[0])
        v.fail(
            f"seq_lens[{s}] = {int(lens[s])} exceeds block_tables capacity "
            f"({tables.shape[1]} blocks x {block_size})"
        )
    for s, seq_len in enumerate(lens.tolist()):
        used = tables[s, : -(-seq_len // block_size)]
        bad = np.nonzero((used < 0) | (used >= num_blocks))[0]
        if bad.size:
            b = int(bad[0])
            v.fail(
                f"block_tables[{s}, {b}] = {int(used[b])} is not a block id (0..{num_blocks - 1})"
            )
