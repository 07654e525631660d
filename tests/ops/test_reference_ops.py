"""The pure-MLX reference ops agree with a naive float64 numpy loop (one token, head, key at a time).

This makes the reference a checked oracle for the native ops rather than the only definition.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import make_batch, to_numpy

from vllm_metal.ops import reference


def naive_attention(
    query: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    cu_seqlens_q: np.ndarray,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: np.ndarray | None,
    key_ends: np.ndarray | None = None,
) -> np.ndarray:
    """The contract of `ops.paged_attention` (its docstring), literally, in float64."""
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.zeros((num_tokens, num_heads, head_size))
    for s in range(len(seq_lens)):
        q_len = int(cu_seqlens_q[s + 1] - cu_seqlens_q[s])
        for i in range(q_len):
            t = int(cu_seqlens_q[s]) + i
            p = int(seq_lens[s]) - q_len + i
            first = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            last = p if key_ends is None else max(p, int(key_ends[t]) - 1)
            for h in range(num_heads):
                kv = h // group
                logits, vals = [], []
                for pos in range(first, last + 1):
                    block = block_tables[s, pos // block_size]
                    k = key_cache[block, pos % block_size, kv].astype(np.float64)
                    x = scale * float(np.dot(query[t, h].astype(np.float64), k))
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    vals.append(value_cache[block, pos % block_size, kv].astype(np.float64))
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    vals.append(np.zeros(head_size))
                m = max(logits)
                w = np.exp(np.asarray(logits) - m)
                out[t, h] = (w[:, None] * np.asarray(vals)).sum(0) / w.sum()
    return out


CASES = [
    {"q_lens": [1, 1], "ctx_lens": [5, 23], "heads": (4, 4)},
    {"q_lens": [6], "ctx_lens": [6], "heads": (4, 2)},
    {"q_lens": [1, 4, 3], "ctx_lens": [19, 12, 3], "heads": (8, 2)},
    {"q_lens": [1, 5], "ctx_lens": [30, 21], "heads": (4, 1), "sliding_window": 7},
    {"q_lens": [3, 1], "ctx_lens": [17, 9], "heads": (4, 2), "softcap": 2.0, "query_scale": 4.0},
    {"q_lens": [2, 1], "ctx_lens": [11, 26], "heads": (4, 2), "sinks": True},
    {
        "q_lens": [4, 1],
        "ctx_lens": [20, 13],
        "heads": (6, 3),
        "sliding_window": 5,
        "softcap": 3.0,
        "sinks": True,
    },
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_reference_attention_matches_numpy_loop(case: dict) -> None:
    rng = np.random.default_rng(7)
    num_heads, num_kv_heads = case["heads"]
    batch = make_batch(
        rng,
        q_lens=case["q_lens"],
        ctx_lens=case["ctx_lens"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=64,
        block_size=8,
        query_scale=case.get("query_scale", 1.0),
    )
    sinks = rng.standard_normal(num_heads).astype(np.float32) * 3 if case.get("sinks") else None
    kwargs = {
        "scale": 0.125,
        "sliding_window": case.get("sliding_window"),
        "softcap": case.get("softcap"),
    }
    got = reference.paged_attention(
        *batch.args, **kwargs, sinks=None if sinks is None else mx.array(sinks)
    )
    want = naive_attention(*(np.asarray(a) for a in batch.args), **kwargs, sinks=sinks)
    np.testing.assert_allclose(to_numpy(got), want, rtol=2e-5, atol=2e-6)


# Prefix-LM spans (`key_ends`): a step of two sequences whose rows in a "span" see its last key.
# Sequence 0: 12 queries at positions 4..15, span 6..11; sequence 1: a decode row, then a
# prefill of 9 at 21..29 with spans 22..24 and 26..29.
SPAN_CASES = [
    {"heads": (4, 2)},
    {"heads": (4, 2), "sliding_window": 3},  # window smaller than the spans: anchored at p
    {"heads": (6, 3), "sliding_window": 9, "softcap": 3.0, "sinks": True},
]


@pytest.mark.parametrize(
    "case", SPAN_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
)
@pytest.mark.parametrize("impl", ["reference", "op"])
def test_key_ends_let_span_rows_see_their_span(case: dict, impl: str) -> None:
    from vllm_metal import ops

    rng = np.random.default_rng(11)
    num_heads, num_kv_heads = case["heads"]
    batch = make_batch(
        rng,
        q_lens=[12, 1, 9],
        ctx_lens=[16, 8, 30],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=64,
        block_size=8,
    )
    key_ends = np.zeros(22, np.int32)  # 0: causal
    key_ends[2:8] = 12  # positions 6..11 of sequence 0 (rows 0..11 sit at 4..15)
    key_ends[14:17] = 25  # positions 22..24 of sequence 2 (rows 13..21 sit at 21..29)
    key_ends[18:22] = 30  # positions 26..29
    sinks = rng.standard_normal(num_heads).astype(np.float32) * 3 if case.get("sinks") else None
    kwargs = {
        "scale": 0.125,
        "sliding_window": case.get("sliding_window"),
        "softcap": case.get("softcap"),
    }
    run = reference.paged_attention if impl == "reference" else ops.paged_attention
    got = run(
        *batch.args, **kwargs, sinks=None if sinks is None else mx.array(sinks), key_ends=key_ends
    )
    arrays = [np.asarray(a) for a in batch.args]
    want = naive_attention(*arrays, **kwargs, sinks=sinks, key_ends=key_ends)
    np.testing.assert_allclose(to_numpy(got), want, rtol=2e-5, atol=2e-6)
    causal = naive_attention(*arrays, **kwargs, sinks=sinks)
    # The spans change exactly the rows that see ahead (not the last row of each span).
    changed = np.abs(want - causal).max(axis=(1, 2)) > 1e-6
    assert changed.nonzero()[0].tolist() == [2, 3, 4, 5, 6, 14, 15, 18, 19, 20]


def test_key_ends_past_the_written_keys_are_refused() -> None:
    from vllm_metal import ops

    batch = make_batch(
        np.random.default_rng(2),
        q_lens=[3],
        ctx_lens=[5],
        num_heads=2,
        num_kv_heads=2,
        head_size=64,
        block_size=8,
    )
    with pytest.raises(ValueError, match=r"key_ends\[1\] = 6 exceeds seq_lens\[0\] = 5"):
        ops.paged_attention(*batch.args, scale=0.125, key_ends=np.array([0, 6, 0]))
    with pytest.raises(ValueError, match="key_ends must be a host array"):
        ops.paged_attention(*batch.args, scale=0.125, key_ends=np.array([0, 1]))


def test_reference_attention_bfloat16_rounds_like_numpy_on_rounded_inputs() -> None:
    rng = np.random.default_rng(3)
    batch = make_batch(
        rng,
        q_lens=[2, 1],
        ctx_lens=[9, 14],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=8,
        dtype="bfloat16",
    )
    got = reference.paged_attention(*batch.args, scale=0.125)
    assert got.dtype == mx.bfloat16
    inputs = [to_numpy(a) if a.dtype == mx.bfloat16 else np.asarray(a) for a in batch.args]
    want = naive_attention(*inputs, scale=0.125, sliding_window=None, softcap=None, sinks=None)
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-2, atol=1e-2)


def test_reference_reshape_and_cache_matches_numpy_assignment() -> None:
    rng = np.random.default_rng(5)
    num_blocks, block_size, heads, head_size = 6, 8, 2, 64
    pool_k = rng.standard_normal((num_blocks, block_size, heads, head_size)).astype(np.float32)
    pool_v = rng.standard_normal((num_blocks, block_size, heads, head_size)).astype(np.float32)
    slots = np.array([17, -1, 3, 40, -5, 47, 0], np.int64)
    key = rng.standard_normal((len(slots), heads, head_size)).astype(np.float32)
    value = rng.standard_normal((len(slots), heads, head_size)).astype(np.float32)

    k_out, v_out = reference.reshape_and_cache(
        mx.array(key), mx.array(value), mx.array(pool_k), mx.array(pool_v), mx.array(slots)
    )
    want_k, want_v = pool_k.copy(), pool_v.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // block_size, slot % block_size] = key[t]
            want_v[slot // block_size, slot % block_size] = value[t]
    np.testing.assert_array_equal(np.asarray(k_out), want_k)
    np.testing.assert_array_equal(np.asarray(v_out), want_v)
