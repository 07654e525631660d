"""The native rotary_embedding matches its reference (neox and GPT-J styles, partial rotary dims, GQA,
every dtype, a float32 cache beside half-precision heads, int32 and int64 positions, clamped
out-of-range positions, strided views, a call large enough for the thread pool); the public entry
point validates its arguments and dispatches to it; and the in-place entry
_C.rotary_embedding_into rotates torch tensors (views of a fused QKV buffer included) as vLLM's
formula, written out below in torch, does.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest
from state_ops import DTYPES, as_f32, assert_y_close, on_threads, spy_native, transposed_view

from vllm_metal.ops.rope import reference, rotary_embedding

MAX_POSITION = 64


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """vLLM's cache: row p holds cos(p f_i) for the rotary_dim / 2 frequencies, then sin(p f_i)."""
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    freqs = np.outer(np.arange(max_position), inv_freq)
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=-1).astype(np.float32)


def make_args(
    rng: np.random.Generator,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    rot: int,
    dtype: str,
    cache_dtype: str | None = None,
    pos_dtype: mx.Dtype = mx.int64,
) -> list[mx.array]:
    """positions, query, key, cos_sin_cache."""
    return [
        mx.array(rng.integers(0, MAX_POSITION, t)).astype(pos_dtype),
        mx.array(rng.standard_normal((t, hq, d)).astype(np.float32)).astype(DTYPES[dtype]),
        mx.array(rng.standard_normal((t, hkv, d)).astype(np.float32)).astype(DTYPES[dtype]),
        mx.array(cos_sin_cache(MAX_POSITION, rot)).astype(DTYPES[cache_dtype or dtype]),
    ]


def check(got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array], dtype: str) -> None:
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert_y_close(g, w, dtype)


SHAPES = [
    (7, 4, 4, 64, 64),  # full rotary, MHA
    (5, 8, 2, 128, 64),  # partial rotary, GQA 4
    (3, 3, 1, 67, 24),  # odd head size: an odd pass-through tail
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d,rot", SHAPES)
def test_matches_reference(
    native: ModuleType, dtype: str, is_neox: bool, t: int, hq: int, hkv: int, d: int, rot: int
) -> None:
    args = make_args(np.random.default_rng(d + rot), t, hq, hkv, d, rot, dtype)
    got = native.rotary_embedding(*args, is_neox)
    check(got, reference.rotary_embedding(*args, is_neox), dtype)
    for g, x in zip(got, args[1:3]):  # the tail passes through bit for bit
        np.testing.assert_array_equal(as_f32(g[..., rot:]), as_f32(x[..., rot:]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("pos_dtype", [mx.int32, mx.int64])
def test_float32_cache_and_position_dtypes(
    native: ModuleType, dtype: str, pos_dtype: mx.Dtype
) -> None:
    args = make_args(np.random.default_rng(1), 6, 4, 2, 64, 32, dtype, "float32", pos_dtype)
    for is_neox in (True, False):
        check(
            native.rotary_embedding(*args, is_neox),
            reference.rotary_embedding(*args, is_neox),
            dtype,
        )


@pytest.mark.parametrize("pos_dtype", [mx.int32, mx.int64])
def test_out_of_range_positions_are_clamped(native: ModuleType, pos_dtype: mx.Dtype) -> None:
    big = 2**31 - 1
    positions = mx.array([-5, 0, MAX_POSITION - 1, MAX_POSITION, big, -big]).astype(pos_dtype)
    clamped = mx.array([0, 0, MAX_POSITION - 1, MAX_POSITION - 1, MAX_POSITION - 1, 0])
    _, q, k, cache = make_args(np.random.default_rng(2), 6, 2, 1, 64, 64, "float32")
    for impl in (native, reference):
        got = impl.rotary_embedding(positions, q, k, cache, True)
        want = reference.rotary_embedding(clamped, q, k, cache, True)
        check(got, want, "float32")
    if pos_dtype == mx.int64:  # beyond int32 too
        far = mx.array([2**40, -(2**40)], dtype=mx.int64)
        got = native.rotary_embedding(far, q[:2], k[:2], cache, False)
        ends = mx.array([MAX_POSITION - 1, 0])
        check(got, reference.rotary_embedding(ends, q[:2], k[:2], cache, False), "float32")


def test_strided_inputs(native: ModuleType) -> None:
    rng = np.random.default_rng(3)
    t, hq, hkv, d, rot = 6, 4, 2, 64, 32
    qkv = mx.array(rng.standard_normal((t, hq + 2 * hkv, d)).astype(np.float32))
    query, key = qkv[:, :hq], qkv[:, hq : hq + hkv]  # views of a fused projection
    positions = mx.array(rng.integers(0, MAX_POSITION, 2 * t))[::2]  # a strided positions array
    cache = mx.array(cos_sin_cache(2 * MAX_POSITION, rot))[::2]  # rows twice as far apart
    for is_neox in (True, False):
        want = reference.rotary_embedding(positions, query, key, cache, is_neox)
        check(native.rotary_embedding(positions, query, key, cache, is_neox), want, "float32")
    # Heads T rows apart, and non-contiguous last axes (which the CPU body stages as copies).
    args = [positions, transposed_view(query, 0, 1), transposed_view(key, 1, 2), cache]
    check(native.rotary_embedding(*args, True), reference.rotary_embedding(*args, True), "float32")
    args[3] = transposed_view(cache, 0, 1)
    check(
        native.rotary_embedding(*args, False), reference.rotary_embedding(*args, False), "float32"
    )


def test_no_tokens_and_no_key_heads(native: ModuleType) -> None:
    positions, q, k, cache = make_args(np.random.default_rng(4), 0, 4, 2, 64, 64, "bfloat16")
    got_q, got_k = native.rotary_embedding(positions, q, k, cache, True)
    assert got_q.shape == (0, 4, 64) and got_k.shape == (0, 2, 64)
    positions, q, k, cache = make_args(np.random.default_rng(4), 3, 4, 0, 64, 64, "float16")
    got = native.rotary_embedding(positions, q, k, cache, True)
    assert got[1].shape == (3, 0, 64)
    check(got, reference.rotary_embedding(positions, q, k, cache, True), "float16")


def test_large_call_uses_threads_and_matches(native: ModuleType) -> None:
    args = make_args(np.random.default_rng(5), 300, 16, 4, 128, 128, "bfloat16")
    want = reference.rotary_embedding(*args, False)
    mx.eval(*want)
    check(on_threads(native, native.rotary_embedding, [*args, False]), want, "bfloat16")


def test_entry_point_dispatches_to_native(native: ModuleType, monkeypatch) -> None:
    args = make_args(np.random.default_rng(6), 4, 2, 2, 64, 32, "float16", "float32", mx.int32)
    calls = spy_native(native, "rotary_embedding", monkeypatch)
    check(rotary_embedding(*args, True), reference.rotary_embedding(*args, True), "float16")
    assert calls == [5]


def _bad(args: list, index: int, value: object) -> list:
    return [value if i == index else a for i, a in enumerate(args)]


@pytest.mark.parametrize(
    "index,value,name",
    [
        (0, mx.zeros((4,), mx.float32), "positions"),
        (0, mx.zeros((4, 1), mx.int32), "positions"),
        (0, mx.zeros((3,), mx.int32), "query"),
        (1, mx.zeros((4, 128)), "query"),
        (1, mx.zeros((4, 2, 64), mx.int32), "query"),
        (2, mx.zeros((4, 2, 32), mx.float16), "key"),
        (2, mx.zeros((4, 2, 64), mx.bfloat16), "key"),
        (3, mx.zeros((64, 31)), "cos_sin_cache"),
        (3, mx.zeros((64, 66)), "cos_sin_cache"),
        (3, mx.zeros((0, 32)), "cos_sin_cache"),
        (3, mx.zeros((64, 32), mx.bfloat16), "cos_sin_cache"),
        (4, 1, "is_neox"),
    ],
)
def test_checks_arguments(index: int, value: object, name: str) -> None:
    args = make_args(np.random.default_rng(7), 4, 2, 2, 64, 32, "float16") + [True]
    rotary_embedding(*args)  # the unchanged arguments are fine
    with pytest.raises(ValueError, match=name):
        rotary_embedding(*_bad(args, index, value))


def test_metal_plan(native: ModuleType) -> None:
    from vllm_metal import _C

    most = _C.CONSTANTS["ROPE_MAX_THREADS"]
    plan = _C.select_rotary_embedding_kernel("bf16", "f32", "i64", 7, 12, 128)
    assert plan == {"kernel": "rotary_embedding_bf16_cf32_i64", "threads": most, "grid": [3, 7, 1]}
    # One head of 67 elements: 34 pairs, rounded up to whole simdgroups.
    assert _C.select_rotary_embedding_kernel("f16", "f16", "i32", 2, 1, 67) == {
        "kernel": "rotary_embedding_f16_cf16_i32",
        "threads": 64,
        "grid": [1, 2, 1],
    }
    with pytest.raises(ValueError, match="cos_sin_cache"):
        _C.select_rotary_embedding_kernel("f16", "bf16", "i32", 1, 1, 64)


# ---------------------------------------------------------------------------------------------
# _C.rotary_embedding_into: in place on torch CPU tensors
# ---------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_rope(
    positions: torch.Tensor,
    x: torch.Tensor,
    cache: torch.Tensor,
    is_neox: bool,
) -> torch.Tensor:
    """vLLM's RotaryEmbedding.forward_static / ApplyRotaryEmb on one [T, H, D] tensor, in float32
    (positions clamped into the cache, as the op's contract states)."""
    rows = cache.float().index_select(0, positions.long().clamp(0, cache.shape[0] - 1))
    cos, sin = rows.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rot = cache.shape[1]
    xr, xp = x.float()[..., :rot], x.float()[..., rot:]
    if is_neox:
        x1, x2 = torch.chunk(xr, 2, dim=-1)
    else:
        x1, x2 = xr[..., ::2], xr[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        out = torch.cat((o1, o2), dim=-1)
    else:
        out = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((out, xp), dim=-1).to(x.dtype)


def assert_torch_close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    assert got.dtype == want.dtype
    assert_y_close(mx.array(got.float().numpy()), mx.array(want.float().numpy()), dtype)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("t,hq,hkv,d,rot", SHAPES)
def test_reference_follows_vllm_formula(
    is_neox: bool, t: int, hq: int, hkv: int, d: int, rot: int
) -> None:
    positions, q, k, cache = make_args(np.random.default_rng(11), t, hq, hkv, d, rot, "float32")
    got = reference.rotary_embedding(positions, q, k, cache, is_neox)
    tcache = torch.from_numpy(np.array(cache))
    for g, x in zip(got, (q, k)):
        want = torch_rope(
            torch.from_numpy(np.array(positions)), torch.from_numpy(np.array(x)), tcache, is_neox
        )
        np.testing.assert_allclose(np.array(g), want.numpy(), atol=1e-6, rtol=1e-6)


def fused_qkv(
    gen: torch.Generator, t: int, hq: int, hkv: int, d: int, dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value views [T, H, D] of a fused projection [T, (Hq + 2 Hkv) D]."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(TORCH_DTYPES[dtype])
    heads = qkv.view(t, hq + 2 * hkv, d)
    return heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_into_rotates_torch_views_in_place(
    native: ModuleType, dtype: str, is_neox: bool, pos_dtype: torch.dtype
) -> None:
    from vllm_metal import _C

    gen = torch.Generator().manual_seed(8)
    t, hq, hkv, d, rot = 5, 8, 2, 128, 64
    q, k, v = fused_qkv(gen, t, hq, hkv, d, dtype)
    positions = torch.tensor([3, 0, -4, MAX_POSITION + 9, 17], dtype=pos_dtype)
    cache = torch.from_numpy(cos_sin_cache(MAX_POSITION, rot)).to(TORCH_DTYPES[dtype])
    want_q, want_k = (
        torch_rope(positions, q, cache, is_neox),
        torch_rope(positions, k, cache, is_neox),
    )
    v_before, ptr = v.clone(), q.data_ptr()
    _C.rotary_embedding_into(positions, q, k, cache, is_neox)
    assert q.data_ptr() == ptr
    assert_torch_close(q, want_q, dtype)
    assert_torch_close(k, want_k, dtype)
    assert torch.equal(v, v_before)  # the value heads of the fused buffer are untouched


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_into_equals_the_mlx_op(native: ModuleType, dtype: str) -> None:
    from vllm_metal import _C

    gen = torch.Generator().manual_seed(9)
    t, hq, hkv, d, rot = 4, 6, 3, 80, 32
    q = torch.randn(hq, t, d, generator=gen).to(TORCH_DTYPES[dtype]).transpose(0, 1)  # strided
    k = torch.randn(t, hkv, d, generator=gen).to(TORCH_DTYPES[dtype])
    positions = torch.tensor([1, 40, 2, 63])
    cache = torch.from_numpy(cos_sin_cache(MAX_POSITION, rot))  # float32 beside half heads

    def to_mx(x: torch.Tensor) -> mx.array:
        return mx.array(x.float().numpy()).astype(DTYPES[dtype])

    want = rotary_embedding(
        mx.array(positions.numpy()), to_mx(q), to_mx(k), mx.array(cache.numpy()), False
    )
    _C.rotary_embedding_into(positions, q, k, cache, False)
    # One CPU driver under both entries: bit for bit.
    np.testing.assert_array_equal(q.float().numpy(), as_f32(want[0]))
    np.testing.assert_array_equal(k.float().numpy(), as_f32(want[1]))


def test_into_without_key_and_large_call(native: ModuleType) -> None:
    from vllm_metal import _C

    gen = torch.Generator().manual_seed(10)
    cache = torch.from_numpy(cos_sin_cache(MAX_POSITION, 128))
    positions = torch.randint(0, MAX_POSITION, (300,), generator=gen)
    q = torch.randn(300, 16, 128, generator=gen)
    want = torch_rope(positions, q, cache, True)
    _C.rotary_embedding_into(positions, q, None, cache, True)
    assert_torch_close(q, want, "float32")


@pytest.mark.parametrize(
    "arg,value,match",
    [
        ("positions", torch.zeros(4), "positions"),
        ("positions", torch.zeros(3, dtype=torch.int64), "query"),
        ("query", torch.zeros(4, 128), "query"),
        ("query", torch.zeros(4, 2, 64, dtype=torch.float64), "query"),
        ("query", torch.zeros(4, 64, 2).transpose(1, 2), "query.*contiguous"),
        ("key", torch.zeros(4, 2, 32), "key"),
        ("key", torch.zeros(4, 2, 64, dtype=torch.float16), "key"),
        ("cos_sin_cache", torch.zeros(64, 31), "cos_sin_cache"),
        ("cos_sin_cache", torch.zeros(64, 66), "cos_sin_cache"),
        ("cos_sin_cache", torch.zeros(0, 32), "cos_sin_cache"),
        ("cos_sin_cache", torch.zeros(64, 32, dtype=torch.float16), "cos_sin_cache"),
    ],
)
def test_into_checks_arguments(native: ModuleType, arg: str, value: object, match: str) -> None:
    from vllm_metal import _C

    args = {
        "positions": torch.zeros(4, dtype=torch.int64),
        "query": torch.zeros(4, 2, 64),
        "key": torch.zeros(4, 2, 64),
        "cos_sin_cache": torch.zeros(64, 32),
    }
    _C.rotary_embedding_into(*args.values(), True)
    args[arg] = value
    with pytest.raises(ValueError, match=match):
        _C.rotary_embedding_into(*args.values(), True)
