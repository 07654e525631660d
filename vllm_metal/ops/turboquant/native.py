"""The TurboQuant ops on the compiled extension (csrc/ops/turboquant/: a C++ CPU body and Metal
kernels; common/turboquant.h states the bytes): the cache write of every preset, and attention
that reads every key and value from the cache at its stored width.

The keys' Hadamard rotation stays in MLX before the ops (`codec.rotate_keys` for the write,
`codec.scoring_space` for the query), so the write stores exactly `codec`'s bytes.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _backend
from vllm_metal.ops.turboquant.codec import (
    TurboQuantFormat,
    centroid_table,
    rotate_keys,
    scoring_space,
)


def module(head_dim: int) -> ModuleType | None:
    """The native module when it serves this call (the Metal kernels take the head sizes of
    TQ_HEAD_SIZES; other sizes on the GPU run the MLX ops), else None."""
    return _backend.native_for(head_dim, "TQ_HEAD_SIZES")


def reads_cache_only(seq_lens: mx.array, cu_seqlens_q: mx.array, longest_short: int) -> bool:
    """Whether every sequence of the step reads all its keys from the cache: none starts its
    context in this step with more than one row, none has more than `longest_short` rows (reads
    the lengths on the host)."""
    cu = np.asarray(cu_seqlens_q, np.int64)
    q_len = cu[1:] - cu[:-1]
    computed = np.asarray(seq_lens, np.int64) - q_len
    fresh = (q_len > 1) & ((computed == 0) | (q_len > longest_short))
    return not bool(fresh.any())


def write(
    native: ModuleType,
    key: mx.array,
    value: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    slot_mapping: mx.array,
    fmt: TurboQuantFormat,
) -> tuple[mx.array, mx.array]:
    k = key.astype(mx.float32)
    if fmt.fp8_keys:
        rows, norms = k, mx.zeros(k.shape[:-1], mx.float32)
    else:
        rows, norms = rotate_keys(k, fmt)
    values = value.astype(mx.float32)
    if native.on_gpu():
        rows, norms, values, slot_mapping = (
            mx.contiguous(a) for a in (rows, norms, values, slot_mapping)
        )
    return native._C.turboquant_write(
        rows,
        norms,
        values,
        key_cache,
        value_cache,
        slot_mapping,
        centroid_table(fmt),
        key_bits=fmt.key_bits,
        value_bits=fmt.value_bits,
    )


def attention(
    native: ModuleType,
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    cu_seqlens_q: mx.array,
    *,
    fmt: TurboQuantFormat,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: mx.array | None,
    decode: bool,
) -> mx.array:
    """Float32 ``[T, Hq, D]``: every query row over keys and values read from the pools."""
    q = scoring_space(query, fmt)
    tables, lens, cu = (a.astype(mx.int32) for a in (block_tables, seq_lens, cu_seqlens_q))
    if native.on_gpu():
        q, tables = mx.contiguous(q), mx.contiguous(tables)
        if not decode:
            # The plan reads the lengths on the host; a decode step's are made from host data.
            mx.eval(lens, cu)
    return native._C.turboquant_attention(
        q,
        key_cache,
        value_cache,
        tables,
        lens,
        cu,
        centroid_table(fmt),
        key_bits=fmt.key_bits,
        value_bits=fmt.value_bits,
        norm_correction=fmt.norm_correction,
        scale=float(scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else sinks.astype(mx.float32),
    )
