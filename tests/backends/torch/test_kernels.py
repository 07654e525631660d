"""The torch ops of vllm_metal.backends.torch.kernels match the pure-MLX references, on KV pools laid
out as the torch backend lays them out: strided views of one int8 buffer per block page, with the
slots no sequence uses poisoned with NaN (so a read of them shows in the output), and queries that
are strided slices of a fused QKV tensor.

(No __init__.py here: a package named `torch` would shadow the real one in pytest's rootdir mode.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.torch import kernels
from vllm_metal.ops.attention import reference as attention_reference
from vllm_metal.ops.cache import reference as cache_reference

MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
DTYPES = list(MX_DTYPE)
# (rtol, atol): float32 differs only by summation order; half types by one output rounding.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (1e-2, 2e-2)}
# Page padding (elements) before the key half and after the value half of every block page.
LEAD, TAIL = 8, 24
# A mixed batch: decode rows, chunked prefills on top of cached context, a fresh prompt.
Q_LENS = [1, 17, 1, 6, 9]
SEQ_LENS = [37, 50, 70, 6, 21]


def to_mx(t: torch.Tensor) -> mx.array:
    """An independent MLX copy of a tensor (via float32 NumPy; exact for the half types)."""
    if t.dtype in MX_DTYPE:
        return mx.array(t.detach().float().contiguous().numpy()).astype(MX_DTYPE[t.dtype])
    return mx.array(t.detach().contiguous().numpy())


def to_numpy(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


@dataclass
class Pages:
    raw: torch.Tensor  # [num_blocks, page_bytes] int8: the allocation
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D] views into raw
    value_cache: torch.Tensor


def make_pages(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> Pages:
    """NaN-filled block pages of LEAD + 2 * block_size * Hkv * D + TAIL elements each, viewed as
    the two pools exactly as the torch backend builds them."""
    itemsize = torch.finfo(dtype).bits // 8
    half = block_size * num_kv_heads * head_size
    page_elems = LEAD + 2 * half + TAIL
    raw = torch.empty(num_blocks, page_elems * itemsize, dtype=torch.int8)
    buf = raw.view(dtype)
    buf.fill_(float("nan"))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    strides = (page_elems, num_kv_heads * head_size, head_size, 1)
    key_cache = torch.as_strided(buf, shape, strides, LEAD)
    value_cache = torch.as_strided(buf, shape, strides, LEAD + half)
    return Pages(raw, key_cache, value_cache)


@dataclass
class Batch:
    query: torch.Tensor
    pages: Pages
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor

    def torch_args(self) -> tuple[torch.Tensor, ...]:
        kv = (self.pages.key_cache, self.pages.value_cache)
        return (self.query, *kv, self.block_tables, self.seq_lens, self.cu_seqlens_q)

    def mx_args(self) -> tuple[mx.array, ...]:
        return tuple(to_mx(t) for t in self.torch_args())


def make_batch(
    gen: torch.Generator,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    q_lens: list[int] = Q_LENS,
    seq_lens: list[int] = SEQ_LENS,
) -> Batch:
    """Each sequence's context in its own shuffled blocks; the table padding points at a block of
    NaN that no sequence uses, and so do the slots past each context's end."""
    used = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(used) + 2  # + a spare and the padding block, both NaN
    pages = make_pages(num_blocks, block_size, num_kv_heads, head_size, dtype)
    nan_block = num_blocks - 1
    order = torch.randperm(num_blocks - 2, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(used) + 1), nan_block, dtype=torch.int32)
    for s, n in enumerate(seq_lens):
        blocks, order = order[: used[s]], order[used[s] :]
        tables[s, : used[s]] = torch.tensor(blocks, dtype=torch.int32)
        for pool in (pages.key_cache, pages.value_cache):
            rows = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
            for t in range(n):
                pool[blocks[t // block_size], t % block_size] = rows[t]

    # The query: a strided slice of a fused [T, (Hq + 2 Hkv) * D] projection.
    num_tokens = sum(q_lens)
    width = (num_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    return Batch(query, pages, tables, torch.tensor(seq_lens, dtype=torch.int32), cu)


def run_op(batch: Batch, **options: object) -> torch.Tensor:
    out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    kernels.paged_attention(out, *batch.torch_args(), **options)
    return out


def check_attention(batch: Batch, **options: object) -> None:
    options.setdefault("scale", batch.query.shape[-1] ** -0.5)
    got = run_op(batch, **options)
    ref_options = dict(options)
    if ref_options.get("sinks") is not None:
        ref_options["sinks"] = to_mx(ref_options["sinks"])
    want = attention_reference.paged_attention(*batch.mx_args(), **ref_options)
    got_np = got.float().numpy()
    assert np.isfinite(got_np).all(), "output has NaN/inf: poisoned memory was read"
    rtol, atol = TOLERANCE[batch.query.dtype]
    np.testing.assert_allclose(got_np, to_numpy(want), rtol=rtol, atol=atol)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_matches_reference(
    dtype: torch.dtype, heads: tuple[int, int], head_size: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_size * 7 + block_size + heads[1])
    batch = make_batch(
        gen,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )
    check_attention(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 8},
        {"softcap": 3.0, "scale": 0.5},
        {"sinks": "float32"},
        {"sinks": "bfloat16"},  # converted to float32 by the op
        {"sliding_window": 5, "softcap": 2.0, "sinks": "float32"},
    ],
    ids=["window", "softcap", "sinks", "bf16-sinks", "all"],
)
def test_paged_attention_options(dtype: torch.dtype, options: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    options = dict(options)
    if "sinks" in options:
        sinks = torch.randn(8, generator=gen) * 2
        options["sinks"] = sinks.to(getattr(torch, options["sinks"]))
    check_attention(batch, **options)


def test_paged_attention_through_torch_ops() -> None:
    """The registered op itself (what the backend's traced graph calls), with explicit 0 options,
    and the extension's entry point called directly."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch(
        gen, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32
    )
    scale = 64**-0.5
    out = torch.empty(batch.query.shape, dtype=torch.float32)
    torch.ops.vllm_metal.paged_attention(out, *batch.torch_args(), scale, 0, 0.0, None)
    want = to_numpy(attention_reference.paged_attention(*batch.mx_args(), scale=scale))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    # The extension's entry point on the tensors themselves (nanobind calls __dlpack__).
    direct = torch.empty(batch.query.shape, dtype=torch.float32)
    kernels._native().paged_attention_into(direct, *batch.torch_args(), scale, 0, 0.0, None)
    np.testing.assert_allclose(direct.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(sys.platform == "darwin", reason="torch on macOS uses LLVM's OpenMP")
def test_kernels_share_torchs_openmp_team() -> None:
    """The ops run on the OpenMP team torch's matmuls use, with torch's thread count, and compute
    what the extension's own thread pool computes, bit for bit (same work partition)."""
    native = kernels._native()
    assert native.host_openmp()
    assert native.num_threads() == torch.get_num_threads()
    gen = torch.Generator().manual_seed(5)
    batch = make_batch(
        gen, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16
    )
    on_openmp = run_op(batch, scale=0.125)
    try:
        assert native.use_host_openmp(False) is False and not native.host_openmp()
        on_pool = run_op(batch, scale=0.125)
    finally:
        assert native.use_host_openmp(True)
    assert torch.equal(on_openmp, on_pool)
    check_attention(batch)


def test_ops_have_fake_implementations() -> None:
    """Under fake tensors the ops run their fake implementation (no kernel, no error)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.empty(3, 4, 64)
        pool = torch.empty(5, 16, 2, 64)
        index = torch.zeros(2, 3, dtype=torch.int32)
        lens = torch.zeros(2, dtype=torch.int32)
        cu = torch.zeros(3, dtype=torch.int32)
        torch.ops.vllm_metal.paged_attention(
            out, out, pool, pool, index, lens, cu, 1.0, 0, 0.0, None
        )
        rows = torch.empty(3, 2, 64)
        torch.ops.vllm_metal.reshape_and_cache(
            rows, rows, pool, pool, torch.zeros(3, dtype=torch.int64)
        )


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_writes_only_given_slots(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size, num_tokens = 6, 2, 64, 13
    pages = make_pages(num_blocks, block_size, num_kv_heads, head_size, dtype)
    # Some blocks already hold data; the rest is NaN.
    pages.key_cache[:3] = torch.randn(3, block_size, num_kv_heads, head_size, generator=gen)
    pages.value_cache[:3] = torch.randn(3, block_size, num_kv_heads, head_size, generator=gen)
    before = pages.raw.clone()

    # Key and value rows: strided slices of a fused [T, (Hq + 2 Hkv) * D] projection (Hq = 4).
    kv_width = num_kv_heads * head_size
    qkv = torch.randn(num_tokens, 4 * head_size + 2 * kv_width, generator=gen).to(dtype)
    key = qkv[:, 4 * head_size : 4 * head_size + kv_width].view(num_tokens, num_kv_heads, -1)
    value = qkv[:, 4 * head_size + kv_width :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding
    want_k, want_v = cache_reference.reshape_and_cache(
        to_mx(key), to_mx(value), to_mx(pages.key_cache), to_mx(pages.value_cache), to_mx(slots)
    )

    kernels.reshape_and_cache(key, value, pages.key_cache, pages.value_cache, slots)

    # The pools equal the reference's (NaN where nothing was ever written, bit-exact elsewhere) ...
    np.testing.assert_array_equal(pages.key_cache.float().numpy(), to_numpy(want_k))
    np.testing.assert_array_equal(pages.value_cache.float().numpy(), to_numpy(want_v))
    # ... and no byte outside the written rows changed (page padding, NaN slots, other rows).
    itemsize = torch.finfo(dtype).bits // 8
    row_bytes = kv_width * itemsize
    half_bytes = block_size * row_bytes
    written = torch.zeros_like(before, dtype=torch.bool)
    for slot in slots.tolist():
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for start in (LEAD * itemsize, LEAD * itemsize + half_bytes):
            begin = start + offset * row_bytes
            written[block, begin : begin + row_bytes] = True
    assert torch.equal(pages.raw[~written], before[~written])
    assert not torch.equal(pages.raw[written], before[written])


# ---- errors: each names the argument ---------------------------------------------------------


def small_batch() -> Batch:
    gen = torch.Generator().manual_seed(5)
    return make_batch(
        gen,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        q_lens=[1, 3],
        seq_lens=[10, 20],
    )


def test_block_tables_dtype_is_checked() -> None:
    batch = small_batch()
    batch.block_tables = batch.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must be int32, got int64"):
        run_op(batch, scale=1.0)


def test_key_cache_heads_must_be_packed() -> None:
    batch = small_batch()
    kc = batch.pages.key_cache
    # Heads 2 * D apart (an interleaved [.., Hkv, 2, D] layout): not readable in place.
    nb, bs, hkv, d = kc.shape
    spread = torch.zeros(nb, bs, hkv, 2, d).select(3, 0)
    spread.copy_(kc)
    batch.pages.key_cache = spread
    with pytest.raises(ValueError, match=r"key_cache must have its heads packed"):
        run_op(batch, scale=1.0)
    # The same pool passes once it is packed.
    batch.pages.key_cache = spread.contiguous()
    check_attention(batch)


def test_head_counts_must_match() -> None:
    batch = small_batch()
    batch.query = torch.randn(batch.query.shape[0], 3, 64)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match=r"query num_heads \(3\) must be a multiple of key_cache"):
        run_op(batch, scale=1.0)

    pages = make_pages(4, 16, 2, 64, torch.float32)
    rows = torch.randn(5, 3, 64)  # 3 KV heads into 2-head pools
    with pytest.raises(ValueError, match=r"key rows .* do not match key_cache"):
        kernels.reshape_and_cache(
            rows, rows, pages.key_cache, pages.value_cache, torch.zeros(5, dtype=torch.int64)
        )


def test_other_arguments_are_checked() -> None:
    batch = small_batch()
    out = torch.empty(batch.query.shape, dtype=torch.float16)
    with pytest.raises(ValueError, match="out dtype float16 differs from query dtype float32"):
        kernels.paged_attention(out, *batch.torch_args(), scale=1.0)
    short = Batch(
        batch.query, batch.pages, batch.block_tables, batch.seq_lens[:1], batch.cu_seqlens_q
    )
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[num_seqs\] = \(2,\)"):
        run_op(short, scale=1.0)
    pages = make_pages(4, 16, 2, 64, torch.float32)
    rows = torch.randn(5, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping must be int64, got int32"):
        kernels.reshape_and_cache(
            rows, rows, pages.key_cache, pages.value_cache, torch.zeros(5, dtype=torch.int32)
        )
