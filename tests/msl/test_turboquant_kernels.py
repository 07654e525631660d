"""Proves the TurboQuant Metal kernels (metal_kernels/turboquant/) through the MSL harness as the
host plans them: turboquant_write stores codec.py's slot bytes byte for byte for the four presets,
and turboquant_decode (decode, GQA head groups, split-KV with turboquant_reduce) computes attention
over the pools as the float64 port of vLLM's decode rules reads them
(tests/fixtures/turboquant_reference.py)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import turboquant_reference as ref
from vllm_metal.kv.turboquant import format_for
from vllm_metal.ops.turboquant import codec

from . import harness
from . import kernels as K

pytestmark = pytest.mark.msl

WRITE_BUF = K._buffer_slots("turboquant", "TQW_BUF_")
WRITE_PARAMS = K._struct("turboquant", "TurboQuantWriteParams")
ATTN_BUF = K._buffer_slots("turboquant", "TQA_BUF_")
ATTN_PARAMS = K._struct("turboquant", "TurboQuantAttentionParams")
PRESETS = list(ref.PRESETS)
FULL = [pytest.mark.slow, pytest.mark.full]


def tiers(ci: list, full: list) -> list:
    """`ci` in CI (where every planted bug is caught: mutate.py runs no full-tier test), `full`
    in the full tier."""
    return [*ci, *(pytest.param(*(p if isinstance(p, tuple) else (p,)), marks=FULL) for p in full)]


def _binds(slots: dict[str, int], params: np.ndarray) -> dict[int, harness.BufferArg]:
    binds: dict[int, harness.BufferArg] = {i: n for n, i in slots.items() if n != "params"}
    binds[slots["params"]] = np.frombuffer(params.tobytes(), np.uint8)
    return binds


def _prepared(fmt, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The key rows and norms the op hands the kernel (the rotation stays in MLX)."""
    if fmt.fp8_keys:
        return key.astype(np.float32), np.zeros(key.shape[:-1], np.float32)
    rotated, norm = codec.rotate_keys(mx.array(key), fmt)
    return np.array(rotated), np.array(norm)


def run_write(fmt, key, value, key_pool, value_pool, slots):
    T, H, D = key.shape
    rows, norms = _prepared(fmt, key)
    launch = K.native().select_turboquant_write_kernel(T, H)
    p = np.zeros((), WRITE_PARAMS)
    nb, bs = key_pool.shape[:2]
    p["num_rows"], p["num_kv_heads"], p["head_dim"], p["block_size"] = T * H, H, D, bs
    p["num_slots"] = nb * bs
    for prefix, pool in (("kc", key_pool), ("vc", value_pool)):
        w = pool.shape[-1]
        p[f"{prefix}_stride_block"], p[f"{prefix}_stride_slot"] = bs * H * w, H * w
        p[f"{prefix}_stride_head"] = w
    p["key_bits"], p["value_bits"] = fmt.key_bits, fmt.value_bits
    bufs = {
        "key": rows,
        "key_norm": norms,
        "value": value.astype(np.float32),
        "key_cache": key_pool.copy(),
        "value_cache": value_pool.copy(),
        "slot_mapping": slots.astype(np.int64),
        "centroids": np.array(codec.centroid_table(fmt)),
    }
    d = harness.Dispatch(
        launch["kernel"], tuple(launch["grid"]), (launch["threads"], 1, 1), _binds(WRITE_BUF, p)
    )
    r = harness.run(K.program("turboquant/write.metal"), bufs, [d], ["key_cache", "value_cache"])
    return r["key_cache"], r["value_cache"]


@pytest.mark.parametrize(
    "name,head_dim",
    tiers(
        [("turboquant_k3v4_nc", 64), ("turboquant_k8v4", 64)],
        [("turboquant_4bit_nc", 64), ("turboquant_3bit_nc", 64), ("turboquant_k3v4_nc", 128)],
    ),
)
def test_write_stores_codec_bytes(name: str, head_dim: int) -> None:
    fmt = format_for(name, head_dim)
    rng = np.random.default_rng(head_dim + len(name))
    heads, nb, bs, T = 2, 5, 8, 30
    key = (rng.normal(size=(T, heads, head_dim)) * rng.uniform(0.1, 4, (T, heads, 1))).astype(
        np.float32
    )
    value = rng.normal(size=(T, heads, head_dim)).astype(np.float32)
    value[0, 1] = np.arange(head_dim) * 1e-10  # a row whose scale is the floor (1e-8)
    kp = rng.integers(0, 256, (nb, bs, heads, fmt.key_bytes), dtype=np.uint8)
    vp = rng.integers(0, 256, (nb, bs, heads, fmt.value_bytes), dtype=np.uint8)
    n = nb * bs
    slots = (1 + rng.choice(n - 2, T, replace=False)).astype(np.int64)
    slots[:4] = [0, n - 1, -1, n]  # first and last slot, padding, out of range
    got_k, got_v = run_write(fmt, key, value, kp, vp, slots)
    kept = (slots >= 0) & (slots < n)
    want_k = kp.reshape(n, heads, -1).copy()
    want_v = vp.reshape(n, heads, -1).copy()
    want_k[slots[kept]] = np.array(codec.quantize_keys(mx.array(key[kept]), fmt))
    want_v[slots[kept]] = np.array(codec.quantize_values(mx.array(value[kept]), fmt))
    np.testing.assert_array_equal(got_k.reshape(n, heads, -1), want_k, err_msg="key pool")
    np.testing.assert_array_equal(got_v.reshape(n, heads, -1), want_v, err_msg="value pool")


def run_attention(fmt, query, key_pool, value_pool, tables, seq_lens, cu, *, scale, window=0,
                  softcap=0.0, sinks=None, num_tokens=None, gpu_cores=None):  # fmt: skip
    """The host's plan of one call, run: decode and (split-KV) reduce. Float32 [T, Hq, D]."""
    T, hq, D = query.shape
    hkv = key_pool.shape[2]
    plan = K.native().select_turboquant_attention_kernel(
        D, hq, hkv, T, list(cu), list(seq_lens), window, gpu_cores
    )
    p = np.zeros((), ATTN_PARAMS)
    nb, bs = key_pool.shape[:2]
    p["num_tokens"], p["num_q_heads"], p["num_kv_heads"], p["head_dim"] = T, hq, hkv, D
    p["num_blocks"], p["block_size"], p["max_blocks_per_seq"] = nb, bs, tables.shape[1]
    for prefix, pool in (("kc", key_pool), ("vc", value_pool)):
        w = pool.shape[-1]
        p[f"{prefix}_stride_block"], p[f"{prefix}_stride_slot"] = bs * hkv * w, hkv * w
        p[f"{prefix}_stride_head"] = w
    p["scale"], p["softcap"], p["sliding_window"] = scale, softcap, window
    p["has_sinks"] = int(sinks is not None)
    p["key_bits"], p["value_bits"] = fmt.key_bits, fmt.value_bits
    p["norm_correction"] = int(fmt.norm_correction)
    for field in ("head_chunks", "partition_size", "num_partitions"):
        p[field] = plan[field]
    rows = T * hq * plan["num_partitions"]
    rotated = np.array(codec.scoring_space(mx.array(query), fmt))
    bufs = {
        "query": rotated,
        "key_cache": key_pool,
        "value_cache": value_pool,
        "block_tables": tables.astype(np.int32),
        "seq_lens": np.asarray(seq_lens, np.int32),
        "cu_seqlens_q": np.asarray(cu, np.int32),
        "sinks": np.zeros(hq, np.float32) if sinks is None else sinks.astype(np.float32),
        "centroids": np.array(codec.centroid_table(fmt)),
        "out": np.full((T, hq, D), np.nan, np.float32),
        "work": np.asarray(plan["work"], np.int32),
        "partial_ml": np.full(rows * 2, np.nan, np.float32),
        "partial_out": np.full(rows * D, np.nan, np.float32),
    }
    binds = _binds(ATTN_BUF, p)
    dispatches = [
        harness.Dispatch(plan["kernel"], tuple(plan["grid"]), (plan["threads"], 1, 1), binds)
    ]
    if plan["partition_size"]:
        dispatches.append(
            harness.Dispatch(
                plan["reduce_kernel"],
                tuple(plan["reduce_grid"]),
                (plan["reduce_threads"], 1, 1),
                binds,
            )
        )
    r = harness.run(K.program("turboquant/decode.metal"), bufs, dispatches, ["out"])
    return r["out"], plan


def _case(name, D, hq, hkv, q_lens, seq_lens, *, bs=8, pad=0, seed=0):
    """Random rows stored through the float64 port into pools of shuffled blocks."""
    rng = np.random.default_rng(seed)
    fmt, layout = format_for(name, D), ref.Layout(name, D)
    per_seq = [math.ceil(n / bs) for n in seq_lens]
    nb = sum(per_seq) + 2
    keys = rng.normal(size=(nb, bs, hkv, D)) * rng.uniform(0.2, 3, (nb, bs, hkv, 1))
    slots = ref.store(layout, keys, rng.normal(size=(nb, bs, hkv, D)))
    kp, vp = slots[..., : fmt.key_bytes], slots[..., fmt.key_bytes :]
    ids = rng.permutation(nb)
    tables = np.full((len(seq_lens), max(per_seq) + 1), -1, np.int64)
    used = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = ids[used : used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    query = rng.normal(size=(int(cu[-1]) + pad, hq, D)).astype(np.float32)
    return fmt, layout, query, np.ascontiguousarray(kp), np.ascontiguousarray(vp), tables, cu


def check(name, D, hq, hkv, q_lens, seq_lens, *, family, window=None, softcap=None,
          sinks=False, pad=0, seed=0, gpu_cores=None):  # fmt: skip
    fmt, layout, query, kp, vp, tables, cu = _case(
        name, D, hq, hkv, q_lens, seq_lens, pad=pad, seed=seed
    )
    sink = np.random.default_rng(seed).normal(size=hq) if sinks else None
    scale = D**-0.5
    out, plan = run_attention(
        fmt, query, kp, vp, tables, seq_lens, cu, scale=scale, window=window or 0,
        softcap=softcap or 0.0, sinks=sink, gpu_cores=gpu_cores,
    )  # fmt: skip
    assert (plan["partition_size"] > 0) == (family == "split"), plan
    assert (plan["head_chunks"] > 1) == (family == "chunks"), plan
    want = ref.paged_attention64(
        layout, query, kp, vp, tables, seq_lens, cu, scale, window, softcap, sink
    )
    assert np.isfinite(out).all(), "rows left unwritten (NaN)"
    err = np.abs(out - want).max() / max(1.0, float(np.abs(want).max()))
    assert err < 2e-5, f"{name} {family}: max error {err:.3g}"


@pytest.mark.parametrize(
    "name",
    tiers(["turboquant_3bit_nc", "turboquant_k8v4"], ["turboquant_4bit_nc", "turboquant_k3v4_nc"]),
)
def test_decode_tq(name: str) -> None:
    check(name, 64, 4, 1, [1, 1, 1], [1, 21, 40], family="decode", sinks=True, pad=1, seed=1)


@pytest.mark.parametrize("name", tiers(["turboquant_k8v4"], ["turboquant_3bit_nc"]))
def test_gqa_decode_tq(name: str) -> None:
    # Continuation and verification rows (q_len > 1) read the cache too; a window and a soft cap.
    check(name, 128, 8, 2, [1, 3, 2], [17, 30, 25], family="gqa", window=12, softcap=20.0,
          seed=2)  # fmt: skip


def test_head_chunks_tq() -> None:
    check("turboquant_k3v4_nc", 64, 12, 1, [1, 1], [9, 26], family="chunks", sinks=True, seed=3)


@pytest.mark.parametrize("name", tiers(["turboquant_4bit_nc"], ["turboquant_3bit_nc"]))
def test_split_kv_tq(name: str) -> None:
    check(name, 64, 4, 2, [1, 1], [300, 170], family="split", sinks=True, seed=4, gpu_cores=8)


@pytest.mark.slow
@pytest.mark.full
def test_split_kv_wide_heads_tq() -> None:
    check("turboquant_k8v4", 256, 2, 1, [1], [270], family="split", softcap=10.0, seed=5,
          gpu_cores=8)  # fmt: skip
