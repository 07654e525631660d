"""The batched pure-MLX paged attention and cache write (what the ops run without native kernels)
agree with the per-sequence reference, with the native op on the CPU, and with a float64 loop."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import assert_close, make_batch, to_numpy
from test_reference_ops import naive_attention

from vllm_metal import ops
from vllm_metal.ops.attention import batched, reference
from vllm_metal.ops.cache import batched as batched_cache
from vllm_metal.ops.cache import reference as cache_reference

BATCHES = {
    "decode": {"q_lens": [1, 1, 1, 1], "ctx_lens": [5, 17, 33, 64]},
    # a mixed step: decode rows, a short chunk, a chunk longer than one tile, an idle sequence
    "mixed": {"q_lens": [1, 7, batched.TILE + 9, 0], "ctx_lens": [9, 20, 130, 4]},
    "padding": {"q_lens": [3, 1], "ctx_lens": [3, 40], "extra_tokens": 2},
}
OPTIONS = {
    "causal": {},
    "window": {"sliding_window": 5},
    "softcap": {"softcap": 5.0},
    "sinks": {"sinks": True},
}


def _call(impl, batch, options, rng):
    kwargs = dict(options)
    if kwargs.pop("sinks", False):
        kwargs["sinks"] = mx.array(rng.standard_normal(8).astype(np.float32) * 2)
    return impl.paged_attention(*batch.args, scale=0.125, **kwargs), kwargs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("shape", BATCHES)
def test_batched_attention_matches_reference(shape: str, option: str, dtype: str) -> None:
    rng = np.random.default_rng(len(shape) * 7 + len(option))
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype, **BATCHES[shape]
    )
    got, kwargs = _call(batched, batch, OPTIONS[option], rng)
    want = reference.paged_attention(*batch.args, scale=0.125, **kwargs)
    assert got.dtype == batch.query.dtype
    assert_close(got, want, dtype)  # finite too: the unused (NaN) slots stay out
    if dtype == "float32" and shape == "mixed":
        arrays = [np.asarray(a) for a in batch.args]
        sinks = kwargs.get("sinks")
        naive = naive_attention(
            *arrays,
            scale=0.125,
            sliding_window=kwargs.get("sliding_window"),
            softcap=kwargs.get("softcap"),
            sinks=None if sinks is None else np.asarray(sinks),
        )
        np.testing.assert_allclose(to_numpy(got), naive, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", BATCHES)
def test_batched_attention_matches_native_on_cpu(native, shape: str) -> None:
    rng = np.random.default_rng(11)
    batch = make_batch(
        rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, **BATCHES[shape]
    )
    got = batched.paged_attention(*batch.args, scale=0.125, sliding_window=9)
    with mx.stream(mx.cpu):
        want = native.paged_attention(*batch.args, scale=0.125, sliding_window=9)
    assert_close(got, want, "float32")


def test_a_step_plan_is_made_once_and_follows_new_arrays() -> None:
    rng = np.random.default_rng(5)
    shape = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16}
    batch = make_batch(rng, q_lens=[1, 3], ctx_lens=[10, 12], **shape)
    plan = batched.plan_for(*batch.args[3:], batch.query.shape[0], 16)
    # every layer of a step passes the same arrays: the same plan
    assert batched.plan_for(*batch.args[3:], batch.query.shape[0], 16) is plan
    other = make_batch(rng, q_lens=[2, 1], ctx_lens=[20, 3], **shape)
    assert_close(
        batched.paged_attention(*other.args, scale=0.125),
        reference.paged_attention(*other.args, scale=0.125),
        "float32",
    )


@pytest.mark.parametrize(
    "slots",
    [[0, 5, 17, 31], [3, -1, 40, 9], [-1, -1, -1, -1]],
    ids=["all", "padding", "none"],
)
def test_batched_cache_write_matches_reference(slots: list[int]) -> None:
    rng = np.random.default_rng(3)
    pool_shape = (4, 8, 2, 64)  # 32 slots; 40 is past the end and skipped
    kc = mx.array(rng.standard_normal(pool_shape).astype(np.float32))
    vc = mx.array(rng.standard_normal(pool_shape).astype(np.float32))
    key = mx.array(rng.standard_normal((4, 2, 64)).astype(np.float32))
    value = mx.array(rng.standard_normal((4, 2, 64)).astype(np.float32))
    slot_mapping = mx.array(np.asarray(slots, np.int64))
    got = batched_cache.reshape_and_cache(key, value, kc, vc, slot_mapping)
    want = cache_reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_ops_without_native_kernels_run_the_batched_path(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    calls = []
    monkeypatch.setattr(batched, "plan_for", lambda *a: calls.append(a) or batched.make_plan(*a))
    rng = np.random.default_rng(8)
    batch = make_batch(
        rng,
        q_lens=[1, 2],
        ctx_lens=[4, 9],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
    )
    assert_close(
        ops.paged_attention(*batch.args, scale=0.125),
        reference.paged_attention(*batch.args, scale=0.125),
        "float32",
    )
    assert len(calls) == 1


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("rows", [1, 4], ids=["decode", "verify"])
def test_a_step_of_equal_rows_traced_by_compile_matches_reference(
    monkeypatch, option, reference_ops, rows
):
    """`max_query_len=m` with `m` query rows per sequence (a decode step, or one verifying
    `m - 1` drafts each): the op reads nothing on the host, so it runs inside mx.compile, and
    still equals the reference (the padding columns of the block tables name a NaN block, which
    stays out)."""
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    rng = np.random.default_rng(len(option) + 3)
    lens = {**BATCHES["decode"], "q_lens": [rows] * len(BATCHES["decode"]["q_lens"])}
    batch = make_batch(rng, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, **lens)
    _, kwargs = _call(batched, batch, OPTIONS[option], rng)
    traced = mx.compile(
        lambda *args: ops.paged_attention(*args, scale=0.125, max_query_len=rows, **kwargs)
    )
    want = reference.paged_attention(*batch.args, scale=0.125, **kwargs)
    assert_close(traced(*batch.args), want, "float32")


def test_a_cache_write_without_padding_traced_by_compile_matches_reference(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    rng = np.random.default_rng(4)
    pool_shape = (4, 8, 2, 64)
    kc = mx.array(rng.standard_normal(pool_shape).astype(np.float32))
    vc = mx.array(rng.standard_normal(pool_shape).astype(np.float32))
    key = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32))
    value = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32))
    slot_mapping = mx.array(np.array([7, 30, 0], np.int64))
    traced = mx.compile(lambda *a: ops.reshape_and_cache(*a, padded=False))
    got = traced(key, value, kc, vc, slot_mapping)
    want = cache_reference.reshape_and_cache(key, value, kc, vc, slot_mapping)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_max_query_len_is_checked() -> None:
    rng = np.random.default_rng(9)
    shape = {"num_heads": 4, "num_kv_heads": 2, "head_size": 64, "block_size": 16}
    decode = make_batch(rng, q_lens=[1, 1], ctx_lens=[4, 9], **shape)
    mixed = make_batch(rng, q_lens=[2, 1], ctx_lens=[4, 9], **shape)
    with pytest.raises(ValueError, match="max_query_len must be a positive integer"):
        ops.paged_attention(*decode.args, scale=0.125, max_query_len=0)
    with pytest.raises(ValueError, match="max_query_len=1 allows at most 2 query rows"):
        ops.paged_attention(*mixed.args, scale=0.125, max_query_len=1)
    with pytest.raises(ValueError, match="max_query_len=1 with rows of equal length cannot take"):
        ops.paged_attention(*decode.args, scale=0.125, max_query_len=1, key_ends=np.array([4, 9]))
    # The longest sequence's rows, not every sequence's: the step's plan is made on the host.
    assert_close(
        ops.paged_attention(*mixed.args, scale=0.125, max_query_len=2),
        reference.paged_attention(*mixed.args, scale=0.125),
        "float32",
    )
