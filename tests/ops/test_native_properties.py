"""Hypothesis-drawn batches (heads, head sizes, block sizes incl. non-powers of two, varlen mixes,
windows, softcap, sinks) give the same native and reference results for both ops.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_batch import DTYPES, assert_close, make_batch, poison_allocator, to_numpy

from vllm_metal.ops import reference

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def batches(draw: st.DrawFn) -> dict:
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    num_seqs = draw(st.integers(1, 4))
    q_lens = draw(st.lists(st.integers(0, 12), min_size=num_seqs, max_size=num_seqs))
    history = draw(st.lists(st.integers(0, 200), min_size=num_seqs, max_size=num_seqs))
    if sum(q_lens) == 0:
        q_lens[0] = 1
    return {
        "num_kv_heads": num_kv_heads,
        "num_heads": num_kv_heads * group,
        "head_size": draw(st.sampled_from([64, 80, 96, 128, 256])),
        "block_size": draw(st.sampled_from([8, 16, 24, 32, 64])),
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "q_lens": q_lens,
        "ctx_lens": [q + h for q, h in zip(q_lens, history)],
        "sliding_window": draw(st.one_of(st.none(), st.integers(1, 64))),
        "softcap": draw(st.one_of(st.none(), st.floats(1.0, 50.0))),
        "sinks": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


@SETTINGS
@given(case=batches())
def test_paged_attention_matches_reference(native: ModuleType, case: dict) -> None:
    rng = np.random.default_rng(case["seed"])
    batch = make_batch(
        rng,
        q_lens=case["q_lens"],
        ctx_lens=case["ctx_lens"],
        num_heads=case["num_heads"],
        num_kv_heads=case["num_kv_heads"],
        head_size=case["head_size"],
        block_size=case["block_size"],
        dtype=case["dtype"],
        query_scale=2.0,
    )
    sinks = None
    if case["sinks"]:
        sinks = mx.array(rng.standard_normal(case["num_heads"]).astype(np.float32) * 2)
    kwargs = {
        "scale": case["head_size"] ** -0.5,
        "sliding_window": case["sliding_window"],
        "softcap": case["softcap"],
        "sinks": sinks,
    }
    poison_allocator(batch.query.nbytes)
    got = native.paged_attention(*batch.args, **kwargs)
    want = reference.paged_attention(*batch.args, **kwargs)
    assert_close(got, want, case["dtype"])


@SETTINGS
@given(
    num_tokens=st.integers(0, 40),
    num_blocks=st.integers(1, 8),
    block_size=st.sampled_from([8, 16, 24, 32]),
    num_kv_heads=st.sampled_from([1, 2, 8]),
    head_size=st.sampled_from([64, 96, 256]),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**31),
)
def test_reshape_and_cache_matches_reference(
    native: ModuleType,
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    num_slots = num_blocks * block_size
    num_tokens = min(num_tokens, num_slots)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    pools = [
        mx.array(rng.standard_normal(shape).astype(np.float32) * 100).astype(DTYPES[dtype])
        for _ in range(2)
    ]
    slots = rng.choice(num_slots, size=num_tokens, replace=False).astype(np.int64)
    slots[rng.random(num_tokens) < 0.2] = -1
    rows = [
        mx.array(
            rng.standard_normal((num_tokens, num_kv_heads, head_size)).astype(np.float32)
        ).astype(DTYPES[dtype])
        for _ in range(2)
    ]
    want = reference.reshape_and_cache(*rows, *pools, mx.array(slots))
    mx.eval(*want)
    got = native.reshape_and_cache(*rows, *pools, mx.array(slots))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w))
