"""The native paged_attention (CPU body) matches the reference over dtypes, head sizes, block sizes,
GQA ratios, windows, softcap, sinks, mixed prefill/decode batches, long contexts and CPU variants.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import Batch, assert_close, make_batch, poison_allocator, to_numpy

from vllm_metal import ops
from vllm_metal.ops import reference
from vllm_metal.ops.attention import batched

# Decode rows first, then a chunked prefill with history and a fresh prompt.
MIXED = {"q_lens": [1, 1, 7, 5], "ctx_lens": [50, 1, 20, 5]}


def run_native(native: ModuleType, batch: Batch, **kwargs: object) -> mx.array:
    poison_allocator(batch.query.nbytes)
    out = native.paged_attention(*batch.args, **kwargs)
    mx.eval(out)
    return out


def check(native: ModuleType, batch: Batch, dtype: str, **kwargs: object) -> mx.array:
    kwargs.setdefault("scale", batch.query.shape[-1] ** -0.5)
    got = run_native(native, batch, **kwargs)
    want = reference.paged_attention(*batch.args, **kwargs)
    assert got.dtype == batch.query.dtype
    assert_close(got, want, dtype)
    return got


@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes_and_head_sizes(native: ModuleType, dtype: str, head_size: int) -> None:
    rng = np.random.default_rng(head_size)
    batch = make_batch(
        rng, **MIXED, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16, dtype=dtype
    )
    check(native, batch, dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_sizes(native: ModuleType, dtype: str, block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    batch = make_batch(
        rng,
        q_lens=[1, 1, 9],
        ctx_lens=[150, 33, 70],
        num_heads=4,
        num_kv_heads=2,
        head_size=128,
        block_size=block_size,
        dtype=dtype,
    )
    check(native, batch, dtype)


@pytest.mark.parametrize("heads", [(4, 4), (8, 4), (8, 2), (16, 2), (8, 1)], ids=str)
def test_gqa_ratios_and_mqa(native: ModuleType, heads: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(heads))
    batch = make_batch(
        rng, **MIXED, num_heads=heads[0], num_kv_heads=heads[1], head_size=64, block_size=16
    )
    check(native, batch, "float32")


@pytest.mark.parametrize("window", [1, 8, 33])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sliding_window(native: ModuleType, dtype: str, window: int) -> None:
    rng = np.random.default_rng(window)
    batch = make_batch(
        rng,
        q_lens=[1, 1, 20, 6],
        ctx_lens=[100, 9, 45, 6],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=8,
        dtype=dtype,
    )
    check(native, batch, dtype, sliding_window=window)


@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap(native: ModuleType, dtype: str, softcap: float) -> None:
    rng = np.random.default_rng(int(softcap))
    # Large queries so that many logits sit in tanh's saturated range.
    batch = make_batch(
        rng,
        **MIXED,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=dtype,
        query_scale=6.0,
    )
    check(native, batch, dtype, softcap=softcap)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sinks(native: ModuleType, dtype: str) -> None:
    rng = np.random.default_rng(11)
    batch = make_batch(
        rng, **MIXED, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype
    )
    sinks = mx.array(rng.standard_normal(8).astype(np.float32) * 3)
    with_sinks = check(native, batch, dtype, sinks=sinks)
    without = run_native(native, batch, scale=0.125)
    # The sinks must actually shrink the weights (outputs differ from the sink-free ones).
    assert np.abs(to_numpy(with_sinks) - to_numpy(without)).max() > 1e-2


def test_window_softcap_and_sinks_together(native: ModuleType) -> None:
    rng = np.random.default_rng(12)
    batch = make_batch(
        rng,
        q_lens=[1, 1, 12],
        ctx_lens=[77, 40, 30],
        num_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype="bfloat16",
        query_scale=3.0,
    )
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    check(native, batch, "bfloat16", sliding_window=16, softcap=20.0, sinks=sinks)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_context_16k(native: ModuleType, threads: int) -> None:
    # Few work items over long key ranges: with 2 threads the key ranges are split and merged.
    native.set_num_threads(threads)
    try:
        rng = np.random.default_rng(16)
        batch = make_batch(
            rng,
            q_lens=[1, 3],
            ctx_lens=[16384, 9000],
            num_heads=2,
            num_kv_heads=1,
            head_size=64,
            block_size=32,
        )
        check(native, batch, "float32", sinks=mx.array(np.array([0.5, -1.0], np.float32)))
    finally:
        native.set_num_threads(0)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cpu_kernel_variants(native: ModuleType, isa: str, dtype: str) -> None:
    if not native.set_cpu_isa(isa):
        pytest.skip(f"this CPU/build has no {isa} variant")
    try:
        assert native.cpu_isa() == isa
        rng = np.random.default_rng(21)
        batch = make_batch(
            rng,
            q_lens=[1, 1, 9],
            ctx_lens=[70, 3, 40],
            num_heads=8,
            num_kv_heads=2,
            head_size=80,
            block_size=16,
            dtype=dtype,
            query_scale=2.0,
        )
        sinks = mx.array(rng.standard_normal(8).astype(np.float32))
        check(native, batch, dtype, sliding_window=24, softcap=10.0, sinks=sinks)
        check(native, batch, dtype)
    finally:
        native.set_cpu_isa("auto")


def test_padding_tokens_get_zeros(native: ModuleType) -> None:
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng, **MIXED, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, extra_tokens=3
    )
    out = check(native, batch, "float32")
    assert not to_numpy(out[-3:]).any()


def test_empty_sequences_in_batch(native: ModuleType) -> None:
    rng = np.random.default_rng(8)
    batch = make_batch(
        rng,
        q_lens=[1, 0, 4, 0],
        ctx_lens=[12, 30, 4, 8],
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=8,
    )
    check(native, batch, "float32")


def test_strided_query_and_pools(native: ModuleType) -> None:
    rng = np.random.default_rng(9)
    base = make_batch(rng, **MIXED, num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    # Query as a transposed view; pools as a head slice of a wider allocation (last stride 1)
    # and as a transposed copy (last stride != 1, copied by the op).
    query = mx.array(np.ascontiguousarray(np.asarray(base.query).transpose(2, 0, 1)))
    query = query.transpose(1, 2, 0)
    wide_k = mx.concatenate([base.key_cache, base.key_cache * 2], axis=2)[:, :, :2]
    wide_v = mx.concatenate([base.value_cache, base.value_cache * 2], axis=2)[:, :, :2]
    tk = mx.array(np.ascontiguousarray(np.asarray(base.key_cache).transpose(0, 1, 3, 2)))
    tv = mx.array(np.ascontiguousarray(np.asarray(base.value_cache).transpose(0, 1, 3, 2)))
    mx.eval(query, wide_k, wide_v, tk, tv)
    for k, v in ((wide_k, wide_v), (tk.swapaxes(2, 3), tv.swapaxes(2, 3))):
        strided = Batch(
            query,
            k,
            v,
            base.block_tables,
            base.seq_lens,
            base.cu_seqlens_q,
            base.q_lens,
            base.ctx_lens,
        )
        got = run_native(native, strided, scale=0.125)
        want = reference.paged_attention(*base.args, scale=0.125)
        assert_close(got, want, "float32")


def test_thread_count_does_not_change_results(native: ModuleType) -> None:
    rng = np.random.default_rng(10)
    batch = make_batch(
        rng,
        q_lens=[1, 40],
        ctx_lens=[3000, 2100],
        num_heads=4,
        num_kv_heads=1,
        head_size=64,
        block_size=16,
    )
    outs = []
    for threads in (1, 2, 3):
        native.set_num_threads(threads)
        outs.append(to_numpy(run_native(native, batch, scale=0.125)))
    native.set_num_threads(0)
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-5, atol=1e-6)


def test_public_op_dispatches_to_native_and_reference(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(13)
    batch = make_batch(rng, **MIXED, num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    assert ops.backend() == "native"
    got = ops.paged_attention(*batch.args, scale=0.125)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(run_native(native, batch, scale=0.125)))
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    assert ops.backend() == "reference"
    ref = ops.paged_attention(*batch.args, scale=0.125)
    # the pure-MLX op is the batched one; the per-sequence reference is its oracle
    np.testing.assert_array_equal(
        to_numpy(ref), to_numpy(batched.paged_attention(*batch.args, scale=0.125))
    )
    assert_close(ref, reference.paged_attention(*batch.args, scale=0.125), "float32")


def test_gpu_stream_without_metal_raises_clearly(native: ModuleType) -> None:
    if native.HAS_METAL:
        pytest.skip("this build has Metal kernels")
    rng = np.random.default_rng(14)
    batch = make_batch(
        rng, q_lens=[1], ctx_lens=[4], num_heads=4, num_kv_heads=2, head_size=64, block_size=8
    )
    try:
        out = native._C.paged_attention(*batch.args, scale=0.1, stream=mx.gpu)
        mx.eval(out)
    except (RuntimeError, ValueError) as exc:
        message = str(exc).lower()
        # Either MLX refuses a GPU it does not have, or our primitive says it has no Metal body.
        assert "without metal" in message or "gpu" in message, message
    else:
        pytest.fail("evaluating on the GPU stream of a build without Metal did not raise")


# --- head sizes without a Metal kernel ------------------------------------------------------------


@pytest.mark.parametrize("head_size", [32, 40, 112, 192])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_sizes_without_a_metal_kernel(native: ModuleType, dtype: str, head_size: int) -> None:
    """The C++ body takes any head size (vector loop plus a scalar tail), windows and sinks too."""
    assert head_size not in ops.HEAD_SIZES
    rng = np.random.default_rng(head_size)
    batch = make_batch(
        rng, **MIXED, num_heads=4, num_kv_heads=2, head_size=head_size, block_size=16, dtype=dtype
    )
    check(native, batch, dtype)
    sinks = mx.array(rng.normal(size=(4,)).astype(np.float32)).astype(batch.query.dtype)
    check(native, batch, dtype, sliding_window=6, sinks=sinks)


def test_gpu_calls_with_other_head_sizes_take_the_reference(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the GPU only the kernels' head sizes reach the native op; the public ops route the rest
    to the reference, which MLX runs on the GPU."""
    from vllm_metal.ops import _backend

    assert _backend.native_for(32) is native  # on the CPU the C++ body takes any size
    monkeypatch.setattr(native, "on_gpu", lambda: True)
    assert _backend.native_for(32) is None and _backend.native_for(112) is None
    assert _backend.native_for(ops.HEAD_SIZES[0]) is native

    calls = []
    monkeypatch.setattr(native, "paged_attention", lambda *a, **k: calls.append(a))
    batch = make_batch(
        np.random.default_rng(0), **MIXED, num_heads=4, num_kv_heads=2, head_size=32, block_size=16
    )
    got = ops.paged_attention(*batch.args, scale=0.2)
    assert calls == []
    assert_close(got, reference.paged_attention(*batch.args, scale=0.2), "float32")
