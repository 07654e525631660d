"""Independent float64 numpy oracle for the attention contract of `ops.paged_attention`, plus
dtype helpers (bfloat16 is carried as uint16 bit patterns, rounded to nearest even)."""

from __future__ import annotations

import numpy as np

DTYPES = ("f32", "f16", "bf16")


def to_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the array a Metal buffer of `dtype` holds (bf16 as uint16 bits)."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "f32":
        return x.copy()
    if dtype == "f16":
        return x.astype(np.float16)
    if dtype == "bf16":
        u = x.view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
    raise ValueError(dtype)


def from_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of to_device: the float32 values a buffer of `dtype` holds."""
    if dtype == "bf16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


def quantize(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (what the kernel actually reads)."""
    return from_device(to_device(x, dtype), dtype)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Copies of the pools with each token's rows written at its slot (negative slot = skip)."""
    kc, vc = key_cache.copy(), value_cache.copy()
    nb, bs = kc.shape[:2]
    for t, slot in enumerate(slot_mapping):
        if slot < 0 or slot >= nb * bs:
            continue
        kc[slot // bs, slot % bs] = key[t]
        vc[slot // bs, slot % bs] = value[t]
    return kc, vc


def paged_attention(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    cu_seqlens_q: np.ndarray,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """out[T, Hq, D] by the varlen paged-attention contract, computed key by key in float64."""
    T, Hq, D = query.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    G = Hq // Hkv
    out = np.zeros((T, Hq, D), np.float64)
    for s in range(len(seq_lens)):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        L = int(seq_lens[s])
        pos_all = np.arange(L)
        blocks = block_tables[s, pos_all // bs]
        K = key_cache[blocks, pos_all % bs].astype(np.float64)  # [L, Hkv, D]
        V = value_cache[blocks, pos_all % bs].astype(np.float64)
        for i in range(q1 - q0):
            p = L - (q1 - q0) + i
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            for h in range(Hq):
                g = h // G
                x = K[lo : p + 1, g] @ query[q0 + i, h].astype(np.float64) * scale
                if softcap:
                    x = softcap * np.tanh(x / softcap)
                m = x.max()
                if sinks is not None:
                    m = max(m, float(sinks[h]))
                w = np.exp(x - m)
                denom = w.sum() + (np.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
                out[q0 + i, h] = (w @ V[lo : p + 1, g]) / denom
    return out.astype(np.float32)
