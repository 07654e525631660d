"""The plain-torch bodies of the torch backend's ops (vllm_metal.backends.torch.torch_ops, the ops'
kernels for `mps` tensors) equal the native CPU ops, run here on `cpu` tensors laid out as the
torch backend lays them out: strided pool views of padded int8 block pages with NaN in every slot
no sequence uses, queries, keys and values that are strided slices of a fused QKV projection.

No Mac here: that the "MPS" dispatch key reaches these bodies is checked through the dispatcher
(the kernel registered for the key, called by redispatch on `cpu` tensors), not on a Metal device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import (
    DTYPES,
    LEAD,
    TOLERANCE,
    Batch,
    make_batch,
    make_pages,
    to_mx,
    to_numpy,
)

from vllm_metal.backends.torch import kernels, torch_ops
from vllm_metal.ops.attention import reference as attention_reference

OPS = ("paged_attention", "reshape_and_cache", "rotary_embedding")
MPS = torch._C.DispatchKeySet(torch._C.DispatchKey.MPS)


def native_attention(batch: Batch, **options: object) -> torch.Tensor:
    out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    kernels.paged_attention(out, *batch.torch_args(), **options)
    return out


def torch_attention(batch: Batch, **options: object) -> torch.Tensor:
    out = torch.full(batch.query.shape, float("nan"), dtype=batch.query.dtype)
    torch_ops.paged_attention(
        out,
        *batch.torch_args(),
        float(options["scale"]),
        int(options.get("sliding_window") or 0),
        float(options.get("softcap") or 0.0),
        options.get("sinks"),
    )
    return out


def check_attention(batch: Batch, *, reference: bool = False, **options: object) -> None:
    """The torch body equals the native op (and, with ``reference``, the MLX reference)."""
    options.setdefault("scale", batch.query.shape[-1] ** -0.5)
    got = torch_attention(batch, **options)
    assert torch.isfinite(got).all(), "output has NaN/inf: poisoned memory was read"
    rtol, atol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got, native_attention(batch, **options), rtol=rtol, atol=atol)
    if reference:
        ref_options = dict(options)
        if ref_options.get("sinks") is not None:
            ref_options["sinks"] = to_mx(ref_options["sinks"])
        want = attention_reference.paged_attention(*batch.mx_args(), **ref_options)
        np.testing.assert_allclose(got.float().numpy(), to_numpy(want), rtol=rtol, atol=atol)


# ---- paged attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_equals_native(
    dtype: torch.dtype, heads: tuple[int, int], head_size: int, block_size: int
) -> None:
    """A mixed batch (decodes, chunked prefills over cached context, a fresh prompt)."""
    gen = torch.Generator().manual_seed(head_size + block_size + heads[1])
    batch = make_batch(
        gen,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
    )
    check_attention(batch, reference=head_size == 64 and block_size == 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 8},
        {"sliding_window": 40},
        {"softcap": 3.0, "scale": 0.5},
        {"sinks": "float32"},
        {"sinks": "bfloat16"},
        {"sliding_window": 5, "softcap": 2.0, "sinks": "float32"},
    ],
    ids=["window", "long-window", "softcap", "sinks", "bf16-sinks", "all"],
)
def test_attention_options_equal_native(dtype: torch.dtype, options: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    batch = make_batch(gen, num_heads=8, num_kv_heads=2, head_size=64, block_size=16, dtype=dtype)
    options = dict(options)
    if "sinks" in options:
        options["sinks"] = (torch.randn(8, generator=gen) * 2).to(getattr(torch, options["sinks"]))
    check_attention(batch, reference=True, **options)


def test_attention_reads_no_block_outside_the_window() -> None:
    """vLLM frees the blocks that slid out of every row's window (their table entries then point
    at a block holding anything): with those pointed at NaN, the result is unchanged."""
    gen = torch.Generator().manual_seed(4)
    window, block_size = 8, 16
    batch = make_batch(
        gen, num_heads=4, num_kv_heads=2, head_size=64, block_size=block_size, dtype=torch.float32
    )
    options = {"scale": 0.125, "sliding_window": window}
    want = native_attention(batch, **options)
    nan_block = batch.pages.key_cache.shape[0] - 1
    cu = batch.cu_seqlens_q.tolist()
    freed = 0
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        first = seq_len - (cu[s + 1] - cu[s])  # the first query row's position
        dead = max(0, first - window + 1) // block_size
        batch.block_tables[s, :dead] = nan_block
        freed += dead
    assert freed >= 3
    got = torch_attention(batch, **options)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_in_chunks_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a small batch budget long sequences' rows split into chunks (with a window, chunks
    whose keys start past block 0) and the chunks into several batched calls: same result."""
    gen = torch.Generator().manual_seed(8)
    batch = make_batch(
        gen,
        num_heads=8,
        num_kv_heads=2,
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        q_lens=[1, 40, 1, 1, 33, 9],
        seq_lens=[5, 90, 130, 17, 33, 60],
    )
    monkeypatch.setattr(torch_ops, "BATCH_ELEMENTS", 32768)
    monkeypatch.setattr(torch_ops, "PADDING_SLACK", 0)
    lens, cu = batch.seq_lens.tolist(), batch.cu_seqlens_q.tolist()
    for window in (0, 12):
        items = torch_ops._work_items(lens, cu, 16, window, 8, 2 * 64)
        groups = torch_ops._groups(items, 16, 8, 2 * 64)
        assert len(items) > 10 and len(groups) > 3 and max(map(len, groups)) > 1
    for options in ({}, {"sliding_window": 12}, {"softcap": 4.0, "sliding_window": 12}):
        check_attention(batch, **options)


def test_attention_zeroes_tokens_outside_every_sequence() -> None:
    gen = torch.Generator().manual_seed(6)
    batch = make_batch(
        gen, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16
    )
    extra = torch.randn(3, *batch.query.shape[1:], generator=gen).to(torch.bfloat16)
    batch.query = torch.cat((batch.query, extra))
    got = torch_attention(batch, scale=0.125)
    assert torch.equal(got[-3:], torch.zeros_like(got[-3:]))
    torch.testing.assert_close(got, native_attention(batch, scale=0.125), rtol=1e-2, atol=2e-2)
    # No sequence at all: every row is zero.
    empty = Batch(
        batch.query,
        batch.pages,
        batch.block_tables[:0],
        batch.seq_lens[:0],
        batch.cu_seqlens_q[:1],
    )
    assert torch.equal(torch_attention(empty, scale=0.125), torch.zeros_like(batch.query))


# ---- cache write --------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cache_write_equals_native_byte_for_byte(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size + 1)
    num_blocks, num_kv_heads, head_size, num_tokens = 6, 2, 64, 13
    native = make_pages(num_blocks, block_size, num_kv_heads, head_size, dtype)
    native.key_cache[:3] = torch.randn(3, block_size, num_kv_heads, head_size, generator=gen)
    native.value_cache[:3] = torch.randn(3, block_size, num_kv_heads, head_size, generator=gen)
    ours = make_pages(num_blocks, block_size, num_kv_heads, head_size, dtype)
    ours.raw.copy_(native.raw)
    before = native.raw.clone()

    kv_width = num_kv_heads * head_size
    qkv = torch.randn(num_tokens, 4 * head_size + 2 * kv_width, generator=gen).to(dtype)
    key = qkv[:, 4 * head_size : 4 * head_size + kv_width].view(num_tokens, num_kv_heads, -1)
    value = qkv[:, 4 * head_size + kv_width :].view(num_tokens, num_kv_heads, head_size)
    # The first and the last slot of the pools among others, and padding.
    num_slots = num_blocks * block_size
    slots = torch.randperm(num_slots - 2, generator=gen)[:num_tokens] + 1
    slots[[0, 5]] = torch.tensor([0, num_slots - 1])
    slots[[2, 7]] = -1

    kernels.reshape_and_cache(key, value, native.key_cache, native.value_cache, slots)
    torch_ops.reshape_and_cache(key, value, ours.key_cache, ours.value_cache, slots)

    assert torch.equal(ours.raw, native.raw)  # every byte, page padding and NaN slots included
    # The written rows are exactly the given ones (11 K rows + 11 V rows of kv_width elements).
    changed = (ours.raw != before).view(num_blocks, -1)
    itemsize = torch.finfo(dtype).bits // 8
    assert not changed[:, : LEAD * itemsize].any()
    rows = ours.key_cache[slots[slots >= 0] // block_size, slots[slots >= 0] % block_size]
    assert torch.equal(rows, key[slots >= 0])


def test_cache_write_with_no_slot_is_a_no_op() -> None:
    pages = make_pages(2, 16, 2, 64, torch.float16)
    before = pages.raw.clone()
    rows = torch.randn(3, 2, 64).half()
    torch_ops.reshape_and_cache(
        rows, rows, pages.key_cache, pages.value_cache, torch.full((3,), -1, dtype=torch.int64)
    )
    assert torch.equal(pages.raw, before)


# ---- rotary embedding --------------------------------------------------------------------------


def cos_sin_cache(max_position: int, rotary_dim: int, dtype: torch.dtype) -> torch.Tensor:
    freqs = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * freqs[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


@pytest.mark.parametrize("cache_dtype", ["float32", "query"])
@pytest.mark.parametrize(("is_neox", "rotary_dim"), [(True, 64), (False, 64), (True, 32)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_equals_native_in_place(
    dtype: torch.dtype, is_neox: bool, rotary_dim: int, cache_dtype: str
) -> None:
    """Query and key rotated in place as views of one fused QKV buffer; the value part and the
    unrotated tail of each head untouched; positions outside the cache clamped."""
    head, hq, hkv, tokens, max_position = 64, 4, 2, 21, 100
    gen = torch.Generator().manual_seed(rotary_dim + is_neox)
    cache = cos_sin_cache(
        max_position, rotary_dim, torch.float32 if cache_dtype == "float32" else dtype
    )
    positions = torch.randint(0, max_position, (tokens,), generator=gen)
    positions[:3] = torch.tensor([-5, max_position, 10**6])
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head, generator=gen).to(dtype)
    want = qkv.clone()

    def split(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = buf.split([hq * head, hkv * head, hkv * head], dim=-1)
        return q.view(tokens, hq, head), k.view(tokens, hkv, head)

    kernels.rotary_embedding(positions, *split(want), cache, is_neox)
    query, key = split(qkv)
    before = qkv.clone()
    torch_ops.rotary_embedding(positions.int(), query, key, cache, is_neox)

    tol = 2e-6 if dtype == torch.float32 else 0.0  # half types: the same float32 value rounded
    torch.testing.assert_close(qkv, want, rtol=tol, atol=tol)
    assert not torch.equal(qkv, before)
    assert torch.equal(qkv[:, (hq + hkv) * head :], before[:, (hq + hkv) * head :])
    assert torch.equal(
        query[..., rotary_dim:], before[:, : hq * head].view(tokens, hq, head)[..., rotary_dim:]
    )
    # Out-of-range positions use the first and the last cache rows.
    clamped = positions.clamp(0, max_position - 1)
    again = before.clone()
    torch_ops.rotary_embedding(clamped, *split(again), cache, is_neox)
    assert torch.equal(again, qkv)


def test_rope_without_key() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = cos_sin_cache(64, 64, torch.float32)
    positions = torch.randint(0, 64, (5,), generator=gen)
    query = torch.randn(5, 2, 64, generator=gen)
    want, key = query.clone(), torch.zeros(5, 1, 64)
    kernels.rotary_embedding(positions, want, key, cache, True)
    torch_ops.rotary_embedding(positions, query, None, cache, True)
    torch.testing.assert_close(query, want, rtol=2e-6, atol=2e-6)


# ---- registration -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_ops_have_cpu_and_mps_kernels(name: str) -> None:
    for key in ("CPU", "MPS"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_metal::{name}", key), key


def test_mps_kernels_are_the_torch_bodies() -> None:
    """The dispatcher's MPS entries, called with the ops' schema arguments (here on `cpu`
    tensors, by redispatch), run the plain-torch bodies."""
    gen = torch.Generator().manual_seed(9)
    batch = make_batch(
        gen, num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32
    )
    want = native_attention(batch, scale=0.125, softcap=5.0)
    out = torch.full(batch.query.shape, float("nan"))
    op = torch.ops.vllm_metal.paged_attention.default
    op.redispatch(MPS, out, *batch.torch_args(), 0.125, 0, 5.0, None)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

    pages = make_pages(2, 16, 2, 64, torch.float32)
    rows = torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor([5, -1, 20])
    torch.ops.vllm_metal.reshape_and_cache.default.redispatch(
        MPS, rows, rows, pages.key_cache, pages.value_cache, slots
    )
    assert torch.equal(pages.value_cache[1, 4], rows[2])

    query = torch.randn(3, 2, 64, generator=gen)
    want_q = query.clone()
    kernels.rotary_embedding(
        slots.clamp(min=0), want_q, None, cos_sin_cache(32, 64, torch.float32), False
    )
    torch.ops.vllm_metal.rotary_embedding.default.redispatch(
        MPS, slots, query, None, cos_sin_cache(32, 64, torch.float32), False
    )
    torch.testing.assert_close(query, want_q, rtol=2e-6, atol=2e-6)
