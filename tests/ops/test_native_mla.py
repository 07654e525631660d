"""The native mla_attention (CPU body) matches its pure-MLX reference over dtypes, latent/value
sizes, many heads reading one latent row, block sizes, mixed decode / chunked-prefill / padding
rows and strided inputs; mla_reshape_and_cache writes exactly the reference's rows, in place; the
reference itself matches a float64 numpy loop; bad arguments raise ValueError naming them; and the
public entry points dispatch (and fall back on the GPU for sizes without a Metal kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from paged_batch import DTYPES, assert_close, poison_allocator, to_numpy

from vllm_metal import ops
from vllm_metal.ops.mla import reference

# Decode rows, a chunked prefill with history, a fresh prompt.
MIXED = {"q_lens": [1, 1, 6, 4], "ctx_lens": [37, 1, 20, 4]}


@dataclass
class MlaBatch:
    query: mx.array
    latent_cache: mx.array
    block_tables: mx.array
    seq_lens: mx.array
    cu_seqlens_q: mx.array

    @property
    def args(self) -> tuple[mx.array, ...]:
        return (self.query, self.latent_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q)


def make_mla_batch(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    latent_dim: int,
    block_size: int = 16,
    dtype: str = "float32",
    extra_tokens: int = 0,
) -> MlaBatch:
    """Sequence s has q_lens[s] new tokens and ctx_lens[s] latent rows. Blocks are shuffled; cache
    rows no sequence owns and the block tables' padding (a spare block) hold NaN, so reading one
    shows. ``extra_tokens`` query rows belong to no sequence."""
    blocks_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = rng.permutation(num_blocks)
    cache = np.full((num_blocks, block_size, latent_dim), np.nan, np.float32)
    tables = np.full((len(q_lens), max(blocks_per_seq + [1]) + 1), order[-1], np.int32)
    used_blocks = iter(order[:-1])
    for s, ctx in enumerate(ctx_lens):
        for b in range(blocks_per_seq[s]):
            block = int(next(used_blocks))
            tables[s, b] = block
            n = min(block_size, ctx - b * block_size)
            cache[block, :n] = rng.standard_normal((n, latent_dim))
    num_tokens = sum(q_lens) + extra_tokens
    query = rng.standard_normal((num_tokens, num_heads, latent_dim)).astype(np.float32)
    batch = MlaBatch(
        query=mx.array(query).astype(DTYPES[dtype]),
        latent_cache=mx.array(cache).astype(DTYPES[dtype]),
        block_tables=mx.array(tables),
        seq_lens=mx.array(np.asarray(ctx_lens, np.int32)),
        cu_seqlens_q=mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
    )
    mx.eval(*batch.args)
    return batch


def run_native(native: ModuleType, batch: MlaBatch, *, scale: float, value_dim: int) -> mx.array:
    poison_allocator(batch.query.shape[0] * batch.query.shape[1] * value_dim * 4)
    out = native.mla_attention(*batch.args, scale=scale, value_dim=value_dim)
    mx.eval(out)
    return out


def check(native: ModuleType, batch: MlaBatch, dtype: str, value_dim: int) -> mx.array:
    scale = 1.5 / math.sqrt(batch.query.shape[2])
    got = run_native(native, batch, scale=scale, value_dim=value_dim)
    want = reference.mla_attention(*batch.args, scale=scale, value_dim=value_dim)
    assert got.dtype == batch.query.dtype
    assert got.shape == (batch.query.shape[0], batch.query.shape[1], value_dim)
    assert_close(got, want, dtype)
    return got


# --- mla_attention: native CPU body against the reference --------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("sizes", [(576, 512), (288, 256), (40, 24), (33, 33)], ids=str)
def test_matches_reference(native: ModuleType, dtype: str, sizes: tuple[int, int]) -> None:
    latent_dim, value_dim = sizes
    rng = np.random.default_rng(latent_dim + value_dim)
    batch = make_mla_batch(
        rng, **MIXED, num_heads=4, latent_dim=latent_dim, dtype=dtype, extra_tokens=2
    )
    got = check(native, batch, dtype, value_dim)
    assert float(mx.abs(got[-2:]).max()) == 0.0  # padding rows: zeros, not stale memory


@pytest.mark.parametrize("threads", [1, 4])
def test_many_heads_share_each_latent_row(native: ModuleType, threads: int) -> None:
    # DeepSeek-V3's 128 heads over one latent row per token: decode rows and a prefill chunk, with
    # the heads of a token in one group (1 thread) or split over threads; same values either way.
    rng = np.random.default_rng(128)
    batch = make_mla_batch(
        rng, q_lens=[1, 1, 3], ctx_lens=[70, 5, 40], num_heads=128, latent_dim=576,
        dtype="bfloat16",
    )  # fmt: skip
    native.set_num_threads(threads)
    try:
        got = check(native, batch, "bfloat16", 512)
    finally:
        native.set_num_threads(0)
    native.set_num_threads(1)
    try:
        single = run_native(native, batch, scale=1.5 / math.sqrt(576), value_dim=512)
    finally:
        native.set_num_threads(0)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(single))


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_block_sizes(native: ModuleType, block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    batch = make_mla_batch(
        rng, q_lens=[1, 9, 1], ctx_lens=[150, 33, 64], num_heads=8, latent_dim=72,
        block_size=block_size, dtype="float16",
    )  # fmt: skip
    check(native, batch, "float16", 64)


def test_empty_sequences_and_no_tokens(native: ModuleType) -> None:
    rng = np.random.default_rng(5)
    batch = make_mla_batch(
        rng, q_lens=[0, 3, 0, 1], ctx_lens=[9, 3, 0, 17], num_heads=2, latent_dim=64
    )
    check(native, batch, "float32", 48)
    empty = make_mla_batch(rng, q_lens=[0], ctx_lens=[4], num_heads=2, latent_dim=64)
    out = native.mla_attention(*empty.args, scale=0.1, value_dim=48)
    assert out.shape == (0, 2, 48)


def test_strided_query_and_cache_slice(native: ModuleType) -> None:
    # The query a concatenation of the absorbed nope part and the rotary part, sliced out of a
    # wider array; the latent cache one layer of a [NB, BS, layers, D] allocation.
    rng = np.random.default_rng(7)
    batch = make_mla_batch(rng, **MIXED, num_heads=4, latent_dim=96)
    wide = mx.concatenate([batch.query, mx.zeros_like(batch.query)], axis=-1)
    layers = mx.stack([mx.zeros_like(batch.latent_cache), batch.latent_cache], axis=2)
    strided = MlaBatch(wide[..., :96], layers[:, :, 1], *batch.args[2:])
    scale = 1.5 / math.sqrt(96)
    want = reference.mla_attention(*batch.args, scale=scale, value_dim=80)
    got = native.mla_attention(*strided.args, scale=scale, value_dim=80)
    assert_close(got, want, "float32")


def test_public_op_dispatches_to_native_and_reference(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    batch = make_mla_batch(rng, **MIXED, num_heads=4, latent_dim=64)
    assert ops.backend() == "native"
    got = ops.mla_attention(*batch.args, scale=0.2, value_dim=32)
    want = run_native(native, batch, scale=0.2, value_dim=32)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    assert ops.backend() == "reference"
    got = ops.mla_attention(*batch.args, scale=0.2, value_dim=32)
    want = reference.mla_attention(*batch.args, scale=0.2, value_dim=32)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_gpu_calls_with_other_sizes_take_the_reference(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_metal.ops import _backend

    assert (576, 512) in ops.MLA_SIZES and (64, 32) not in ops.MLA_SIZES
    assert _backend.native_for((64, 32), sizes="MLA_SIZES") is native  # CPU: any size
    monkeypatch.setattr(native, "on_gpu", lambda: True)
    assert _backend.native_for((64, 32), sizes="MLA_SIZES") is None
    assert _backend.native_for((576, 64), sizes="MLA_SIZES") is None
    assert _backend.native_for(ops.MLA_SIZES[0], sizes="MLA_SIZES") is native

    calls = []
    monkeypatch.setattr(native, "mla_attention", lambda *a, **k: calls.append(a))
    batch = make_mla_batch(np.random.default_rng(0), **MIXED, num_heads=2, latent_dim=64)
    got = ops.mla_attention(*batch.args, scale=0.2, value_dim=32)
    assert calls == []
    assert_close(got, reference.mla_attention(*batch.args, scale=0.2, value_dim=32), "float32")


def test_metal_plan(native: ModuleType) -> None:
    from vllm_metal import _C

    heads = _C.CONSTANTS["MLA_HEADS"]
    plan = _C.select_mla_attention_kernel("bf16", 2 * heads + 1, 576, 512, 7)
    assert plan["kernel"] == "mla_attention_bf16_d576_v512"
    assert plan["threads"] == heads * 32 and plan["grid"] == [3, 7, 1]
    assert 1 <= plan["keys"] <= _C.CONSTANTS["MLA_MAX_KEYS"]
    small = _C.select_mla_attention_kernel("f32", 3, 288, 256, 1)
    assert small["threads"] == 96 and small["grid"] == [1, 1, 1]
    with pytest.raises(ValueError, match="no Metal kernel"):
        _C.select_mla_attention_kernel("f16", 4, 576, 256, 1)
    cache = _C.select_mla_reshape_and_cache_kernel("f16", 576, 9)
    assert cache["kernel"] == "mla_reshape_and_cache_f16" and cache["grid"] == [9, 1, 1]


@pytest.mark.parametrize("reference_ops", [False, True], ids=["native", "pure-mlx"])
@pytest.mark.parametrize("rows", [1, 4], ids=["decode", "verify"])
def test_a_step_of_equal_rows_traced_by_compile_matches_reference(
    monkeypatch: pytest.MonkeyPatch, rows: int, reference_ops: bool
) -> None:
    """`max_query_len=m` with `m` query rows per sequence: the op (the native one, or without it
    the batched pure-MLX graph) reads nothing on the host, so it runs inside mx.compile, and
    equals the per-sequence reference; the block tables' padding names a NaN block, which stays
    out. The cache write with every slot in range (`padded=False`) traces too."""
    if reference_ops:
        monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    rng = np.random.default_rng(rows)
    batch = make_mla_batch(
        rng, q_lens=[rows] * 4, ctx_lens=[5, 17, 33, 64], num_heads=4, latent_dim=64
    )
    traced = mx.compile(
        lambda *a: ops.mla_attention(*a, scale=0.2, value_dim=48, max_query_len=rows)
    )
    want = reference.mla_attention(*batch.args, scale=0.2, value_dim=48)
    assert_close(traced(*batch.args), want, "float32")
    cache = mx.array(rng.standard_normal((4, 16, 64)).astype(np.float32))
    latent = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    slots = mx.array(np.array([7, 40, 0], np.int64))
    write = mx.compile(lambda *a: ops.mla_reshape_and_cache(*a, padded=False))
    want = reference.mla_reshape_and_cache(latent, mx.array(cache), slots)
    np.testing.assert_array_equal(np.asarray(write(latent, cache, slots)), np.asarray(want))


def test_max_query_len_is_checked() -> None:
    batch = make_mla_batch(
        np.random.default_rng(5), q_lens=[2, 1], ctx_lens=[4, 9], num_heads=2, latent_dim=32
    )
    with pytest.raises(ValueError, match="max_query_len must be a positive integer"):
        ops.mla_attention(*batch.args, scale=0.2, value_dim=16, max_query_len=0)
    with pytest.raises(ValueError, match="max_query_len=1 allows at most 2 query rows"):
        ops.mla_attention(*batch.args, scale=0.2, value_dim=16, max_query_len=1)
    # The longest sequence's rows, not every sequence's: the per-sequence path runs.
    assert_close(
        ops.mla_attention(*batch.args, scale=0.2, value_dim=16, max_query_len=2),
        reference.mla_attention(*batch.args, scale=0.2, value_dim=16),
        "float32",
    )


# --- the reference against an independent float64 loop ----------------------------------------


def test_reference_matches_numpy_loop() -> None:
    rng = np.random.default_rng(3)
    batch = make_mla_batch(rng, **MIXED, num_heads=3, latent_dim=24, block_size=8)
    got = np.asarray(reference.mla_attention(*batch.args, scale=0.3, value_dim=16))
    cache = np.asarray(batch.latent_cache).astype(np.float64)
    tables, lens = np.asarray(batch.block_tables), np.asarray(batch.seq_lens)
    cu, query = np.asarray(batch.cu_seqlens_q), np.asarray(batch.query).astype(np.float64)
    for s, seq_len in enumerate(lens):
        q_len = cu[s + 1] - cu[s]
        for i in range(q_len):
            t, pos = cu[s] + i, seq_len - q_len + i
            keys = np.arange(pos + 1)
            rows = cache[tables[s, keys // 8], keys % 8]  # [pos + 1, D]
            for h in range(3):
                x = rows @ query[t, h] * 0.3
                w = np.exp(x - x.max())
                np.testing.assert_allclose(got[t, h], w @ rows[:, :16] / w.sum(), atol=1e-5)


# --- mla_reshape_and_cache ---------------------------------------------------------------------


def random_cache(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> mx.array:
    cache = mx.array((rng.standard_normal(shape) * 1e3).astype(np.float32)).astype(DTYPES[dtype])
    mx.eval(cache)
    return cache


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cache_write_matches_reference_and_skips_padding(native: ModuleType, dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    num_blocks, block_size, latent_dim = 6, 16, 576
    cache = random_cache(rng, (num_blocks, block_size, latent_dim), dtype)
    slots = rng.choice(num_blocks * block_size, size=12, replace=False).astype(np.int64)
    slots[[1, 6]] = -1  # padding
    slots[9] = num_blocks * block_size  # past the end: skipped
    latent = mx.array(rng.standard_normal((12, latent_dim)).astype(np.float32)).astype(cache.dtype)
    want = reference.mla_reshape_and_cache(latent, cache, mx.array(slots))
    mx.eval(want)
    before = to_numpy(cache).copy()
    got = native.mla_reshape_and_cache(latent, cache, mx.array(slots))
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))
    changed = np.nonzero((to_numpy(got) != before).any(axis=2).reshape(-1))[0]
    assert set(changed.tolist()) <= set(slots[(slots >= 0) & (slots < 96)].tolist())


def test_cache_write_is_in_place_and_feeds_attention(native: ModuleType) -> None:
    # A runner step: write this step's latent rows, then attend, with one eval at the end.
    rng = np.random.default_rng(9)
    batch = make_mla_batch(rng, q_lens=[1, 3], ctx_lens=[20, 3], num_heads=4, latent_dim=64)
    tables = np.asarray(batch.block_tables)
    slots = np.array(
        [tables[0, 19 // 16] * 16 + 19 % 16] + [tables[1, 0] * 16 + i for i in range(3)],
        np.int64,
    )
    latent = mx.array(rng.standard_normal((4, 64)).astype(np.float32))
    new_cache = native.mla_reshape_and_cache(latent, batch.latent_cache, mx.array(slots))
    out = native.mla_attention(batch.query, new_cache, *batch.args[2:], scale=0.125, value_dim=48)
    mx.eval(out)
    # The returned cache shares the input's memory: the old handle sees the rows too.
    np.testing.assert_array_equal(np.asarray(batch.latent_cache[tables[1, 0], 2]), latent[3])
    want_cache = reference.mla_reshape_and_cache(latent, batch.latent_cache, mx.array(slots))
    want = reference.mla_attention(
        batch.query, want_cache, *batch.args[2:], scale=0.125, value_dim=48
    )
    assert_close(out, want, "float32")


def test_cache_write_broadcast_pool_is_materialised(native: ModuleType) -> None:
    cache = mx.broadcast_to(mx.zeros((1, 1, 32)), (3, 8, 32))
    latent = mx.ones((2, 32))
    got = native.mla_reshape_and_cache(latent, cache, mx.array(np.array([0, 23])))
    want = reference.mla_reshape_and_cache(latent, cache, mx.array(np.array([0, 23])))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(mx.abs(cache).max()) == 0.0


def test_large_cache_write_uses_threads_and_matches(native: ModuleType) -> None:
    rng = np.random.default_rng(4)
    cache = random_cache(rng, (64, 32, 576), "bfloat16")
    slots = rng.permutation(64 * 32)[:1200].astype(np.int64)
    slots[::50] = -1
    latent = mx.array(rng.standard_normal((1200, 576)).astype(np.float32)).astype(mx.bfloat16)
    want = reference.mla_reshape_and_cache(latent, cache, mx.array(slots))
    mx.eval(want)
    got = native.mla_reshape_and_cache(latent, cache, mx.array(slots))
    np.testing.assert_array_equal(to_numpy(got), to_numpy(want))


def test_public_cache_write_dispatches(native: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    latent = mx.array(rng.standard_normal((3, 64)).astype(np.float32))
    slots = mx.array(np.array([4, -1, 40], np.int64))
    cache = random_cache(np.random.default_rng(20), (4, 16, 64), "float32")
    want = reference.mla_reshape_and_cache(latent, cache, slots)
    mx.eval(want)
    got = ops.mla_reshape_and_cache(latent, cache, slots)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    fresh = random_cache(np.random.default_rng(20), (4, 16, 64), "float32")
    got = ops.mla_reshape_and_cache(latent, fresh, slots)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- validation ----------------------------------------------------------------------------------

T, H, D, DV, NB, BS, S, MAXB = 5, 4, 64, 48, 6, 16, 2, 3


def attention_args() -> dict[str, Any]:
    return {
        "query": mx.zeros((T, H, D)),
        "latent_cache": mx.zeros((NB, BS, D)),
        "block_tables": mx.zeros((S, MAXB), dtype=mx.int32),
        "seq_lens": mx.array([3, 20], dtype=mx.int32),
        "cu_seqlens_q": mx.array([0, 1, 5], dtype=mx.int32),
        "scale": 0.125,
        "value_dim": DV,
    }


def cache_args() -> dict[str, Any]:
    return {
        "latent": mx.zeros((T, D)),
        "latent_cache": mx.zeros((NB, BS, D)),
        "slot_mapping": mx.arange(T).astype(mx.int64),
    }


Mutate = Callable[[dict[str, Any]], None]

ATTENTION_ERRORS: list[tuple[str, Mutate, str]] = [
    ("query-ndim", lambda a: a.update(query=mx.zeros((T, H * D))), "query"),
    ("query-type", lambda a: a.update(query=np.zeros((T, H, D))), "query"),
    ("query-dtype", lambda a: a.update(query=mx.zeros((T, H, D), dtype=mx.int32)), "query"),
    ("cache-ndim", lambda a: a.update(latent_cache=mx.zeros((NB, BS, 1, D))), "latent_cache"),
    ("cache-block", lambda a: a.update(latent_cache=mx.zeros((NB, 12, D))), "block_size"),
    ("cache-empty", lambda a: a.update(latent_cache=mx.zeros((0, BS, D))), "latent_cache"),
    ("cache-dim", lambda a: a.update(latent_cache=mx.zeros((NB, BS, D + 1))), "latent_cache"),
    (
        "cache-dtype",
        lambda a: a.update(latent_cache=mx.zeros((NB, BS, D), dtype=mx.float16)),
        "latent_cache",
    ),
    (
        "bt-dtype",
        lambda a: a.update(block_tables=mx.zeros((S, MAXB), dtype=mx.int64)),
        "block_tables",
    ),
    ("bt-ndim", lambda a: a.update(block_tables=mx.zeros((S,), dtype=mx.int32)), "block_tables"),
    ("sl-len", lambda a: a.update(seq_lens=mx.array([3], dtype=mx.int32)), "seq_lens"),
    (
        "cu-dtype",
        lambda a: a.update(cu_seqlens_q=mx.array([0, 1, 5], dtype=mx.int64)),
        "cu_seqlens_q",
    ),
    ("scale-inf", lambda a: a.update(scale=float("inf")), "scale"),
    ("value-dim-zero", lambda a: a.update(value_dim=0), "value_dim"),
    ("value-dim-wide", lambda a: a.update(value_dim=D + 1), "value_dim"),
    ("value-dim-float", lambda a: a.update(value_dim=48.0), "value_dim"),
    ("value-dim-bool", lambda a: a.update(value_dim=True), "value_dim"),
]

CACHE_ERRORS: list[tuple[str, Mutate, str]] = [
    ("latent-ndim", lambda a: a.update(latent=mx.zeros((T, 1, D))), "latent"),
    ("latent-dim", lambda a: a.update(latent=mx.zeros((T, D - 1))), "latent"),
    ("latent-dtype", lambda a: a.update(latent=mx.zeros((T, D), dtype=mx.bfloat16)), "latent"),
    ("cache-block", lambda a: a.update(latent_cache=mx.zeros((NB, 4, D))), "block_size"),
    (
        "cache-int",
        lambda a: a.update(latent_cache=mx.zeros((NB, BS, D), dtype=mx.int8)),
        "latent_cache",
    ),
    ("slots-dtype", lambda a: a.update(slot_mapping=mx.arange(T)), "slot_mapping"),
    (
        "slots-len",
        lambda a: a.update(slot_mapping=mx.arange(T + 1).astype(mx.int64)),
        "slot_mapping",
    ),
]


@pytest.fixture(params=["native", "reference"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native" and not ops.native_available():
        pytest.skip("native extension unavailable")
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1" if request.param == "reference" else "0")
    assert ops.backend() == request.param
    return request.param


def call_attention(**args: Any) -> mx.array:
    names = ("query", "latent_cache", "block_tables", "seq_lens", "cu_seqlens_q")
    positional = [args.pop(n) for n in names]
    return ops.mla_attention(*positional, **args)


@pytest.mark.parametrize(
    ("case", "mutate", "name"), ATTENTION_ERRORS, ids=[c[0] for c in ATTENTION_ERRORS]
)
def test_attention_errors_name_the_argument(
    backend: str, case: str, mutate: Mutate, name: str
) -> None:
    args = attention_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        call_attention(**args)


@pytest.mark.parametrize(("case", "mutate", "name"), CACHE_ERRORS, ids=[c[0] for c in CACHE_ERRORS])
def test_cache_errors_name_the_argument(backend: str, case: str, mutate: Mutate, name: str) -> None:
    args = cache_args()
    mutate(args)
    with pytest.raises(ValueError, match=name):
        ops.mla_reshape_and_cache(**args)


def test_valid_arguments_pass(backend: str) -> None:
    out = call_attention(**attention_args())
    assert out.shape == (T, H, DV)
    mx.eval(out, ops.mla_reshape_and_cache(**cache_args()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_lens": [3, 49]}, "block_tables capacity"),
        ({"block_tables": [[0, 0, 0], [1, 7, 0]]}, "block_tables\\[1, 1\\]"),
        ({"seq_lens": [3, 2]}, "seq_lens\\[1\\]"),
    ],
)
def test_value_checks(change: dict[str, Any], message: str) -> None:
    args = attention_args()
    for key, value in change.items():
        args[key] = mx.array(np.asarray(value, np.int32))
    ops.set_value_checks(True)
    try:
        with pytest.raises(ValueError, match=message):
            call_attention(**args)
        cache = cache_args()
        cache["slot_mapping"] = mx.array(np.array([0, -1, NB * BS, 3, 4], np.int64))
        with pytest.raises(ValueError, match="slot_mapping\\[2\\]"):
            ops.mla_reshape_and_cache(**cache)
    finally:
        ops.set_value_checks(False)
