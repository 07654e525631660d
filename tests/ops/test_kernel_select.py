"""Proves the host's Metal kernel choice rules (the planners of csrc/ops/*/plan.cpp) on plain
shapes, through vllm_metal._C.select_*_kernel (no GPU). That every name is instantiated by the
Metal sources is proven by tests/msl/test_kernels.py."""

from __future__ import annotations

import math
from typing import Any

import mlx.core  # noqa: F401  (loads libmlx, which the extension links against)
import pytest

from vllm_metal import _C

C = _C.CONSTANTS


def plan(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    dtype: str = "f16",
    hq: int = 8,
    hkv: int = 2,
    d: int = 128,
    block_size: int = 32,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    return _C.select_paged_attention_kernel(dtype, hq, hkv, d, block_size, cu, seq_lens, **kwargs)[
        "launches"
    ]


def test_kernel_names_cover_every_list_entry() -> None:
    names = _C.all_kernel_names()
    assert len(names) == len(set(names))
    for tag, *_ in C["FLOAT_DTYPES"]:
        assert f"reshape_and_cache_{tag}" in names
        for d in C["DECODE_HEAD_SIZES"]:
            assert f"paged_attention_reduce_{tag}_d{d}" in names
            for b in C["BLOCK_DIVISORS"]:
                for family in ("decode", "gqa", "prefill"):
                    assert f"paged_attention_{family}_{tag}_d{d}_b{b}" in names
    for tag, *_ in C["HALF_DTYPES"]:
        for d in C["HEAD_SIZES"]:
            assert f"paged_attention_nax_{tag}_d{d}" in names
    for tag, *_ in C["FLOAT_DTYPES"]:
        for pos in ("i32", "i64"):
            assert f"rotary_embedding_{tag}_c{tag}_{pos}" in names
            assert f"rotary_embedding_{tag}_cf32_{pos}" in names


def test_pure_decode_uses_gqa_kernel_and_env_switch_restores_per_head_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (launch,) = plan([1, 1, 1], [10, 20, 30], dtype="bf16", hq=24, hkv=4, d=256)
    assert launch["kernel"] == "paged_attention_gqa_bf16_d256_b32"
    assert launch["grid"][:2] == [4, 3]  # one threadgroup per kv head (6 heads <= 8) and row
    assert launch["work"] == [0, 1, 2]
    assert launch["partition_size"] == 0

    monkeypatch.setenv("VLLM_METAL_DISABLE_GQA_DECODE", "1")
    (launch,) = plan([1, 1, 1], [10, 20, 30], dtype="bf16", hq=24, hkv=4, d=256)
    assert launch["family"] == "decode"
    assert launch["kernel"] == "paged_attention_decode_bf16_d256_b32"
    assert launch["grid"][:2] == [24, 3]


def test_mha_decode_and_group_tiling() -> None:
    (launch,) = plan([1], [5], hq=4, hkv=4)
    assert launch["family"] == "decode"
    (launch,) = plan([1], [5], hq=20, hkv=2)  # 10 heads per kv head -> two tiles of 8
    assert launch["family"] == "gqa" and launch["grid"][0] == 4


@pytest.mark.parametrize(
    ("block_size", "kernel_block"), [(8, 8), (16, 16), (24, 8), (32, 32), (64, 32), (128, 32)]
)
def test_vllm_blocks_map_onto_kernel_blocks(block_size: int, kernel_block: int) -> None:
    (launch,) = plan([1], [100], hq=4, hkv=4, block_size=block_size)
    assert launch["kernel_block"] == kernel_block
    assert block_size % launch["kernel_block"] == 0


def test_float32_head_dim_256_gqa_uses_smaller_tile() -> None:
    (launch,) = plan([1], [100], dtype="f32", hq=24, hkv=4, d=256, block_size=64)
    assert launch["kernel"] == "paged_attention_gqa_f32_d256_b32"
    assert launch["kernel_block"] == 16  # 32-key tiles do not fit threadgroup memory


def test_prefill_tiles_cover_token_head_rows() -> None:
    (launch,) = plan([7, 3], [7, 10], hq=8, hkv=2)  # G = 4
    assert launch["family"] == "prefill"
    bq = launch["rows_per_tile"]
    expected = [(0, t) for t in range(math.ceil(7 * 4 / bq))]
    expected += [(1, t) for t in range(math.ceil(3 * 4 / bq))]
    assert list(zip(launch["work"][::2], launch["work"][1::2], strict=True)) == expected
    assert launch["grid"] == [len(expected), 2, 1]
    assert launch["threads"] == bq * 4


def test_mixed_batch_splits_out_only_long_decode_rows() -> None:
    launches = plan([1, 5, 1], [4096, 50, 4095], hq=8, hkv=2)
    assert [launch["family"] for launch in launches] == ["prefill", "gqa"]
    prefill, decode = launches
    assert sorted(set(prefill["work"][::2])) == [1, 2]  # the short decode row stays in the tile
    assert decode["work"] == [0]

    (only,) = plan([1, 5], [4095, 50], hq=8, hkv=2)
    assert only["family"] == "prefill"


def test_sliding_window_counts_attended_keys_for_split_out() -> None:
    launches = plan([1, 5], [100_000, 50], hq=8, hkv=2, sliding_window=1024)
    assert [launch["family"] for launch in launches] == ["prefill"]


def test_split_kv_scratch_is_sized_per_request() -> None:
    seq_lens = [5000, 100, 1300]
    (launch,) = plan([1, 1, 1], seq_lens, hq=8, hkv=8)
    size = C["PARTITION_SIZE"]
    assert launch["partition_size"] == size
    parts = [math.ceil(n / size) for n in seq_lens]
    assert launch["part_offsets"] == [0, parts[0], parts[0] + parts[1], sum(parts)]
    assert launch["total_partitions"] == sum(parts) < len(seq_lens) * max(parts)
    assert launch["grid"] == [8, 3, max(parts)]
    assert launch["scratch_heads"] == 8
    assert launch["reduce_kernel"] == "paged_attention_reduce_f16_d128"
    assert launch["reduce_grid"][:2] == [8, 3]


def test_split_kv_partitions_start_at_window() -> None:
    (launch,) = plan([1], [10_000], hq=8, hkv=8, sliding_window=1000)
    first = 10_000 - 1000
    base = first - first % C["PARTITION_ALIGN"]
    assert launch["part_offsets"] == [0, math.ceil((10_000 - base) / C["PARTITION_SIZE"])]


def test_gqa_split_scratch_pads_head_groups() -> None:
    (launch,) = plan([1], [9000], hq=24, hkv=4, d=256, dtype="bf16")
    assert launch["family"] == "gqa" and launch["partition_size"] == C["PARTITION_SIZE"]
    assert launch["scratch_heads"] == 4 * C["GQA_ROWS"]


def test_no_split_when_grid_already_fills_the_gpu() -> None:
    (launch,) = plan([1] * 64, [5000] * 64, hq=32, hkv=32)
    assert launch["partition_size"] == 0
    (launch,) = plan([1] * 4, [300] * 4, hq=8, hkv=8)  # short rows: nothing to split
    assert launch["partition_size"] == 0


def test_nax_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    (launch,) = plan([9], [9], dtype="bf16", d=512, supports_nax=True)
    assert launch["kernel"] == "paged_attention_nax_bf16_d512"
    assert launch["grid"][1] == 2 * 2  # two 256-column halves per kv head
    assert launch["rows_per_tile"] == 16

    (launch,) = plan([9], [9], dtype="f32", supports_nax=True)
    assert launch["family"] == "prefill"
    (launch,) = plan([9], [9], dtype="f16", supports_nax=True, block_size=8)
    assert launch["family"] == "prefill"
    (launch,) = plan([9], [9], dtype="f16", supports_nax=False)
    assert launch["family"] == "prefill"

    monkeypatch.setenv("VLLM_METAL_DISABLE_NAX", "1")
    (launch,) = plan([9], [9], dtype="f16", supports_nax=True)
    assert launch["family"] == "prefill"


def test_head_dim_512_decode_rows_use_prefill_kernel() -> None:
    (launch,) = plan([1], [100], dtype="bf16", d=512)
    assert launch["kernel"] == "paged_attention_prefill_bf16_d512_b32"
    assert (launch["rows_per_tile"], launch["kernel_block"]) == (16, 8)
    assert launch["grid"][1] == 2 * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "f32", "d": 512}, "head_dim 512"),
        ({"d": 72}, "head_dim 72"),
        ({"block_size": 12}, "block_size"),
        ({"dtype": "f64"}, "dtype"),
        ({"hq": 6, "hkv": 4}, "multiple"),
    ],
)
def test_unsupported_shapes_are_rejected(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan([3], [3], **kwargs)


def test_reshape_and_cache_kernel() -> None:
    choice = _C.select_reshape_and_cache_kernel("bf16", 2, 80)
    assert choice == {"kernel": "reshape_and_cache_bf16", "threads": 160}
    assert _C.select_reshape_and_cache_kernel("f32", 8, 128)["threads"] == 256


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pools_take_the_fp8_instance_of_every_family(fmt: str) -> None:
    """fp8 pools plan exactly the launches of float pools, each with its family's _fp8 instance
    (the format is a kernel argument); the split-KV reduce kernel reads no pool and is shared."""
    cases = [
        ([1, 1], [40, 2000], {}),  # GQA decode, a long row split
        ([1, 1], [40, 2000], {"hq": 2, "hkv": 2}),  # per-head decode, split
        ([9, 1], [9, 5000], {}),  # prefill and a long decode row of its own
        ([9], [9], {"dtype": "bf16", "d": 512}),  # wide heads: prefill only
        ([9], [9], {"supports_nax": True}),  # NAX prefill
    ]
    for q_lens, seq_lens, kwargs in cases:
        same = plan(q_lens, seq_lens, gpu_cores=1, **kwargs)
        fp8 = plan(q_lens, seq_lens, gpu_cores=1, kv_cache_dtype=fmt, **kwargs)
        assert [launch["family"] for launch in fp8] == [launch["family"] for launch in same]
        tag = kwargs.get("dtype", "f16")
        for a, b in zip(same, fp8):
            assert b["kernel"] == a["kernel"].replace(f"_{tag}_", f"_{tag}_fp8_", 1)
            assert b["reduce_kernel"] == a["reduce_kernel"]
            assert {k: v for k, v in b.items() if k != "kernel"} == {
                k: v for k, v in a.items() if k != "kernel"
            }
    names = set(_C.all_kernel_names())
    assert {launch["kernel"] for launch in plan([1, 9], [50, 9], kv_cache_dtype=fmt)} <= names
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        plan([1], [4], kv_cache_dtype="fp8")  # the format is named, as ops.fp8 resolves it


def test_reshape_and_cache_fp8_kernel() -> None:
    choice = _C.select_reshape_and_cache_kernel("bf16", 2, 80, "fp8_e5m2")
    assert choice == {"kernel": "reshape_and_cache_bf16_fp8", "threads": 160}
    assert "reshape_and_cache_f32_fp8" in _C.all_kernel_names()
