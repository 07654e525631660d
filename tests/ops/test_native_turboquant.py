"""The native TurboQuant ops (C++ CPU bodies here): the cache write stores codec.py's slot bytes
byte for byte (and the float64 port of vLLM's store, off rounding boundaries), attention over the
pools equals a float64 attention over what the port decodes (decode rows, continuation and
verification chunks, GQA, windows, soft-capping, sinks, split-KV); ops.turboquant sends rows that
read the cache to the native op, a prefill chunk over its own rows to MLX's ops, and everything to
MLX's ops with VLLM_METAL_USE_REFERENCE_OPS=1; the Metal planner's choices."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import turboquant_reference as ref
from vllm_metal.kv.turboquant import format_for
from vllm_metal.ops import turboquant
from vllm_metal.ops.turboquant import codec
from vllm_metal.ops.turboquant import native as tq_native

PRESETS = list(ref.PRESETS)
FULL = [pytest.mark.slow, pytest.mark.full]
# CI runs one preset with 3-bit and one with fp8 keys; the full tier every preset.
WRITE_PRESETS = [
    "turboquant_k3v4_nc",
    "turboquant_k8v4",
    *(pytest.param(n, marks=FULL) for n in ("turboquant_4bit_nc", "turboquant_3bit_nc")),
]


def _rows(rng, shape, spread=2.0) -> np.ndarray:
    x = rng.normal(size=shape) * spread * rng.uniform(0.1, 4.0, size=(*shape[:-1], 1))
    x[0, 0] = 0.0  # a zero key (norm 0) and a constant value row (scale at its floor)
    return x.astype(np.float32)


@pytest.mark.parametrize("name", WRITE_PRESETS)
def test_native_write_stores_codec_and_vllm_bytes(native, name: str) -> None:
    rng = np.random.default_rng(3)
    head_dim, heads, n = 64, 2, 37
    fmt, layout = format_for(name, head_dim), ref.Layout(name, head_dim)
    keys, values = _rows(rng, (n, heads, head_dim)), _rows(rng, (n, heads, head_dim), 1.0)
    slots = rng.choice(6 * 16, n, replace=False).astype(np.int64)
    slots[:2] = [-1, 6 * 16]  # padding and out of range: skipped
    start = rng.integers(0, 256, (6, 16, heads, fmt.key_bytes + fmt.value_bytes), np.uint8)
    kc, vc = turboquant.reshape_and_cache(
        mx.array(keys).astype(mx.bfloat16), mx.array(values).astype(mx.bfloat16),
        mx.array(start[..., : fmt.key_bytes]), mx.array(start[..., fmt.key_bytes :]),
        mx.array(slots), fmt=fmt,
    )  # fmt: skip
    got = np.concatenate([np.array(kc), np.array(vc)], axis=-1).reshape(-1, heads, start.shape[-1])
    kept = slots >= 0
    kept[1] = False
    rows_k = np.array(mx.array(keys).astype(mx.bfloat16).astype(mx.float32))
    rows_v = np.array(mx.array(values).astype(mx.bfloat16).astype(mx.float32))
    want = start.reshape(got.shape).copy()
    want[slots[kept]] = np.concatenate(
        [
            np.array(codec.quantize_keys(mx.array(rows_k[kept]), fmt)),
            np.array(codec.quantize_values(mx.array(rows_v[kept]), fmt)),
        ],
        axis=-1,
    )
    np.testing.assert_array_equal(got, want)
    # The port's bytes decode to the same keys and values except where float32 may round a
    # coordinate to the neighbouring level.
    k_port, v_port = ref.decode(layout, ref.store(layout, rows_k[kept], rows_v[kept]))
    k_got, v_got = ref.decode(layout, got[slots[kept]])
    k_near, v_near = ref.near_boundary(layout, rows_k[kept], rows_v[kept], 1e-5)
    if not layout.fp8_keys:  # an index moved shows in the rotated space only
        k_port, k_got = k_port @ ref.hadamard(head_dim), k_got @ ref.hadamard(head_dim)
    np.testing.assert_allclose(k_got[~k_near], k_port[~k_near], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_got[~v_near], v_port[~v_near], rtol=1e-6, atol=1e-6)


def _pools(rng, layout, heads, seq_lens, block_size=16):
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, heads, layout.head_dim)
    slots = ref.store(layout, rng.normal(size=shape) * 2, rng.normal(size=shape))
    ids = rng.permutation(num_blocks)
    tables = np.zeros((len(seq_lens), max(per_seq)), np.int32)
    used = 0
    for s, k in enumerate(per_seq):
        tables[s, :k] = ids[used : used + k]
        used += k
    kb = layout.key_bytes
    return np.ascontiguousarray(slots[..., :kb]), np.ascontiguousarray(slots[..., kb:]), tables


@pytest.mark.parametrize(
    "name,window,softcap,with_sinks,threads",
    [
        ("turboquant_3bit_nc", 40, 30.0, True, 0),
        *(
            pytest.param(n, w, c, k, t, marks=FULL)
            for n in PRESETS
            for w, c, k, t in [(None, None, False, 0), (40, 30.0, True, 1)]
        ),
    ],
)
def test_native_attention_reads_what_the_port_decodes(
    native, name, window, softcap, with_sinks, threads
) -> None:
    """Decode rows, a verification chunk (3 rows) and a continuation chunk (9 rows), GQA; with
    one thread no row is split, with the pool's default long rows are."""
    rng = np.random.default_rng(5)
    head_dim, hq, hkv = 64, 6, 2
    layout, fmt = ref.Layout(name, head_dim), format_for(name, head_dim)
    q_lens, seq_lens = [1, 3, 9, 1], [600, 41, 120, 1]
    kp, vp, tables = _pools(rng, layout, hkv, seq_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.normal(size=(int(cu[-1]) + 2, hq, head_dim)).astype(np.float32)  # 2 padding
    sinks = rng.normal(size=hq).astype(np.float32) if with_sinks else None
    scale = head_dim**-0.5
    native.set_num_threads(threads)
    out = turboquant.paged_attention(
        mx.array(query), mx.array(kp), mx.array(vp), mx.array(tables),
        mx.array(np.array(seq_lens, np.int32)), mx.array(cu), fmt=fmt, scale=scale,
        sliding_window=window, softcap=softcap, sinks=None if sinks is None else mx.array(sinks),
    )  # fmt: skip
    want = ref.paged_attention64(
        layout, query, kp, vp, tables, seq_lens, cu, scale, window, softcap, sinks
    )
    np.testing.assert_allclose(np.array(out), want, rtol=2e-5, atol=2e-5)


def test_ops_send_rows_that_read_the_cache_to_the_native_op(native, monkeypatch) -> None:
    rng = np.random.default_rng(8)
    head_dim, heads = 64, 2
    fmt, layout = format_for("turboquant_k3v4_nc", head_dim), ref.Layout("turboquant_k3v4_nc", 64)
    kp, vp, tables = _pools(rng, layout, heads, [30, 20])
    calls = []
    real = tq_native.attention
    monkeypatch.setattr(tq_native, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def attend(q_lens, seq_lens, fresh: bool, **options) -> mx.array:
        cu = mx.array(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        t = int(sum(q_lens))
        rows = mx.array(rng.normal(size=(t, heads, head_dim)).astype(np.float32))
        return turboquant.paged_attention(
            rows, mx.array(kp), mx.array(vp), mx.array(tables),
            mx.array(np.array(seq_lens, np.int32)), cu, fmt=fmt, scale=0.125,
            key=rows if fresh else None, value=rows if fresh else None, **options,
        )  # fmt: skip

    attend([1, 1], [30, 20], False, max_query_len=1)  # decode
    attend([4, 1], [30, 20], True)  # a verification chunk and a decode row, with the fresh rows
    assert len(calls) == 2
    attend([20, 1], [20, 20], True)  # a first chunk attends over its own rows: MLX's ops
    attend([1, 1], [30, 20], False, max_query_len=1)
    assert len(calls) == 3
    monkeypatch.setenv("VLLM_METAL_USE_REFERENCE_OPS", "1")
    attend([1, 1], [30, 20], False, max_query_len=1)
    assert len(calls) == 3


def test_metal_plan(native) -> None:
    select = native._C.select_turboquant_attention_kernel
    # Decode of three sequences and a padding row, GQA 4: one pass, one chunk per KV head.
    plan = select(128, 8, 2, 4, [0, 1, 2, 3], [10, 20, 30], gpu_cores=1)
    assert plan["kernel"] == "turboquant_decode_d128" and plan["partition_size"] == 0
    assert plan["grid"] == (4, 2, 1) and plan["work"] == [0, 1, 2, -1]
    # 12 query heads of one KV head: two chunks of at most 8.
    assert select(64, 12, 1, 1, [0, 1], [5])["head_chunks"] == 2
    # One long row on many cores splits into partitions of >= 128 keys that cover it.
    plan = select(64, 4, 4, 1, [0, 1], [4000], gpu_cores=32)
    parts, size = plan["num_partitions"], plan["partition_size"]
    assert parts > 1 and size >= 128 and (parts - 1) * size < 4000 <= parts * size
    assert plan["reduce_kernel"] == "turboquant_reduce_d64" and plan["reduce_grid"] == (1, 4, 1)
    # A window bounds the keys a row reads, so it is not split.
    assert select(64, 4, 4, 1, [0, 1], [4000], 100, gpu_cores=32)["partition_size"] == 0
    with pytest.raises(ValueError, match="head_dim 80"):
        select(80, 4, 4, 1, [0, 1], [10])
    names = set(native._C.all_kernel_names())
    assert {"turboquant_write", "turboquant_decode_d256", "turboquant_reduce_d64"} <= names
