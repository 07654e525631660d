"""Drives metal_kernels/<op>/*.metal through the MSL harness the way the host encodes them: the
buffer slots and argument structs of csrc/ops/<op>/params.h (read from those headers), launch
plans and constants from vllm_metal._C."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import harness
from .oracle import from_device, to_device

KERNEL_DIR = harness.KERNEL_DIR
PARAMS_DIR = harness.SHARED_INCLUDE_DIR / "ops"

FAMILY_SOURCE = {
    "reshape_and_cache": "cache/reshape_and_cache.metal",
    "decode": "attention/decode.metal",
    "reduce": "attention/decode.metal",
    "gqa": "attention/gqa.metal",
    "prefill": "attention/prefill.metal",
    "nax": "attention/nax.metal",
    "gated_delta_rule": "gated_delta/gated_delta_rule.metal",
    "causal_conv1d": "short_conv/causal_conv1d.metal",
    "mamba2_scan": "mamba2/mamba2_scan.metal",
    "mla_attention": "mla/mla_attention.metal",
    "mla_reshape_and_cache": "mla/mla_reshape_and_cache.metal",
    "rotary_embedding": "rope/rotary_embedding.metal",
}

_FIELD_TYPES = {"int": "<i4", "long_t": "<i8", "float": "<f4"}


def _buffer_slots(op: str, prefix: str) -> dict[str, int]:
    """`#define <prefix>NAME n` of csrc/ops/<op>/params.h as {"name": n}."""
    text = (PARAMS_DIR / op / "params.h").read_text()
    return {m[1].lower(): int(m[2]) for m in re.finditer(rf"#define {prefix}(\w+) (\d+)", text)}


def _struct(op: str, name: str) -> np.dtype:
    """The argument struct `name` of csrc/ops/<op>/params.h, laid out as the C compiler does."""
    text = (PARAMS_DIR / op / "params.h").read_text()
    body = re.search(rf"struct {name} {{(.*?)\n}};", text, re.DOTALL)[1]
    fields = re.findall(r"^\s*(int|long_t|float)\s+(\w+);", body, re.MULTILINE)
    return np.dtype([(n, _FIELD_TYPES[ty]) for ty, n in fields], align=True)


BUF = _buffer_slots("attention", "PA_BUF_")
CACHE_BUF = _buffer_slots("cache", "RC_BUF_")
PA_PARAMS = _struct("attention", "PagedAttentionParams")
CACHE_PARAMS = _struct("cache", "ReshapeAndCacheParams")
GDR_BUF = _buffer_slots("gated_delta", "GDR_BUF_")
GDR_PARAMS = _struct("gated_delta", "GatedDeltaParams")
SC_BUF = _buffer_slots("short_conv", "SC_BUF_")
SC_PARAMS = _struct("short_conv", "CausalConv1dParams")
M2_BUF = _buffer_slots("mamba2", "M2_BUF_")
M2_PARAMS = _struct("mamba2", "Mamba2ScanParams")
MLA_BUF = _buffer_slots("mla", "MLA_BUF_")
MLA_PARAMS = _struct("mla", "MlaAttentionParams")
MLC_BUF = _buffer_slots("mla", "MLC_BUF_")
MLC_PARAMS = _struct("mla", "MlaReshapeAndCacheParams")
ROPE_BUF = _buffer_slots("rope", "ROPE_BUF_")
ROPE_PARAMS = _struct("rope", "RotaryEmbeddingParams")


@functools.cache
def program(source_name: str, kernel_dir: Path = KERNEL_DIR) -> harness.Program:
    return harness.compile_source(kernel_dir / source_name)


def native():
    """vllm_metal._C (the host's kernel-choice functions and constants)."""
    import mlx.core  # noqa: F401  (loads libmlx for the extension)

    from vllm_metal import _C

    return _C


def constant(name: str) -> object:
    return native().CONSTANTS[name]


# --------------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------------


def reshape_and_cache(
    key: np.ndarray,
    value: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    slot_mapping: np.ndarray,
    dtype: str,
    kernel_dir: Path = KERNEL_DIR,
    *,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Run reshape_and_cache_<dtype>[_fp8]; float32 rows in (already representable in dtype).
    Pools: float32 in and out, or (kv_cache_dtype fp8_e4m3 / fp8_e5m2, int8 / fp8_per_token_head)
    uint8 bytes in and out (per-token-head rows: D bytes and the row's scale)."""
    T, H, D = key.shape
    nb, bs, _, W = key_cache.shape
    fp8 = kv_cache_dtype != "auto"
    pool_dtype = "u8" if fp8 else dtype
    launch = native().select_reshape_and_cache_kernel(dtype, H, D, kv_cache_dtype)
    p = np.zeros((), CACHE_PARAMS)
    p["num_tokens"], p["num_kv_heads"], p["head_dim"] = T, H, D
    p["num_slots"] = nb * bs
    p["key_stride_token"], p["key_stride_head"] = H * D, D
    p["value_stride_token"], p["value_stride_head"] = H * D, D
    p["kv_stride_block"], p["kv_stride_slot"], p["kv_stride_head"] = bs * H * W, H * W, W
    p["block_size"] = bs
    p["kv_format"] = kv_format(kv_cache_dtype)
    p["k_scale"], p["v_scale"] = k_scale, v_scale
    bufs = {
        "key": to_device(key, dtype),
        "value": to_device(value, dtype),
        "key_cache": pool_to_device(key_cache, pool_dtype),
        "value_cache": pool_to_device(value_cache, pool_dtype),
        "slot_mapping": slot_mapping.astype(np.int64),
    }
    binds: dict[int, harness.BufferArg] = {i: n for n, i in CACHE_BUF.items() if n != "params"}
    binds[CACHE_BUF["params"]] = np.frombuffer(p.tobytes(), np.uint8)
    d = harness.Dispatch(launch["kernel"], (T, 1, 1), (launch["threads"], 1, 1), binds)
    r = harness.run(
        program(FAMILY_SOURCE["reshape_and_cache"], kernel_dir),
        bufs,
        [d],
        ["key_cache", "value_cache"],
    )
    if fp8:
        return r["key_cache"], r["value_cache"]
    return from_device(r["key_cache"], dtype), from_device(r["value_cache"], dtype)


def kv_format(kv_cache_dtype: str) -> int:
    """The kernels' kv_format of a kv_cache_dtype (constants.h's ids)."""
    if kv_cache_dtype == "auto":
        return constant("KV_FORMAT_SAME")
    formats = (*constant("FP8_FORMATS"), *constant("PTH_FORMATS"))
    return {e[0]: e[1] for e in formats}[kv_cache_dtype]


def pool_to_device(x: np.ndarray, dtype: str) -> np.ndarray:
    """A pool as its buffer holds it: fp8 bytes ("u8") as they are, floats by `to_device`."""
    return x.astype(np.uint8) if dtype == "u8" else to_device(x, dtype)


def _single_launch(
    family: str,
    launch: dict,
    slots: dict[str, int],
    params: np.ndarray,
    bufs: dict[str, np.ndarray],
    outputs: dict[str, tuple[tuple[int, ...], str]],
    kernel_dir: Path,
) -> tuple[np.ndarray, ...]:
    """One dispatch of a one-kernel op as its host plans it (buffers named as its slots). Each
    output {name: (shape, dtype)} is a new buffer that starts as NaN; returns their float32 values,
    in order."""
    for name, (shape, dtype) in outputs.items():
        bufs[name] = to_device(np.full(shape, np.nan, np.float32), dtype)
    binds: dict[int, harness.BufferArg] = {i: n for n, i in slots.items() if n != "params"}
    binds[slots["params"]] = np.frombuffer(params.tobytes(), np.uint8)
    d = harness.Dispatch(launch["kernel"], tuple(launch["grid"]), (launch["threads"], 1, 1), binds)
    r = harness.run(program(FAMILY_SOURCE[family], kernel_dir), bufs, [d], list(outputs))
    return tuple(from_device(r[name], dtype) for name, (_, dtype) in outputs.items())


# --------------------------------------------------------------------------------------------
# gated_delta_rule, causal_conv1d and mamba2_scan (outputs start as NaN: rows a kernel leaves
# out show)
# --------------------------------------------------------------------------------------------


def gated_delta_rule(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    cu_seqlens: np.ndarray,
    dtype: str,
    kernel_dir: Path = KERNEL_DIR,
) -> tuple[np.ndarray, np.ndarray]:
    """Run gated_delta_rule_<dtype>; float32 in (q/k/v representable in dtype), float32 out."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    S = state.shape[0]
    launch = native().select_gated_delta_rule_kernel(dtype, Hv, Dk, Dv, S)
    p = np.zeros((), GDR_PARAMS)
    p["num_tokens"], p["num_seqs"], p["num_k_heads"], p["num_v_heads"] = T, S, Hk, Hv
    p["key_dim"], p["value_dim"] = Dk, Dv
    bufs = {
        "q": to_device(q, dtype),
        "k": to_device(k, dtype),
        "v": to_device(v, dtype),
        "g": g.astype(np.float32),
        "beta": beta.astype(np.float32),
        "state": state.astype(np.float32),
        "cu_seqlens": cu_seqlens.astype(np.int32),
    }
    outputs = {"out": (v.shape, dtype), "state_out": (state.shape, "f32")}
    return _single_launch("gated_delta_rule", launch, GDR_BUF, p, bufs, outputs, kernel_dir)


def causal_conv1d(
    x: np.ndarray,
    weight: np.ndarray,
    conv_state: np.ndarray,
    cu_seqlens: np.ndarray,
    dtype: str,
    bias: np.ndarray | None = None,
    kernel_dir: Path = KERNEL_DIR,
) -> tuple[np.ndarray, np.ndarray]:
    """Run causal_conv1d_<dtype>; float32 in (representable in dtype), float32 out. Without a
    bias, a one-element NaN buffer is bound in its slot (the host binds another buffer there)."""
    T, C = x.shape
    S, keep, _ = conv_state.shape
    launch = native().select_causal_conv1d_kernel(dtype, T, S, C, keep + 1)
    p = np.zeros((), SC_PARAMS)
    p["num_tokens"], p["num_seqs"], p["channels"], p["width"] = T, S, C, keep + 1
    p["has_bias"] = bias is not None
    bufs = {
        "x": to_device(x, dtype),
        "weight": to_device(weight, dtype),
        "conv_state": to_device(conv_state, dtype),
        "cu_seqlens": cu_seqlens.astype(np.int32),
        "bias": to_device(np.full(1, np.nan, np.float32) if bias is None else bias, dtype),
    }
    outputs = {"out": (x.shape, dtype), "state_out": (conv_state.shape, dtype)}
    return _single_launch("causal_conv1d", launch, SC_BUF, p, bufs, outputs, kernel_dir)


def mamba2_scan(
    x: np.ndarray,
    dt: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C: np.ndarray,
    D: np.ndarray,
    state: np.ndarray,
    cu_seqlens: np.ndarray,
    dtype: str,
    kernel_dir: Path = KERNEL_DIR,
) -> tuple[np.ndarray, np.ndarray]:
    """Run mamba2_scan_<dtype>; float32 in (x/B/C representable in dtype), float32 out."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    S = state.shape[0]
    launch = native().select_mamba2_scan_kernel(dtype, H, P, N, S)
    p = np.zeros((), M2_PARAMS)
    p["num_tokens"], p["num_seqs"], p["num_heads"], p["num_groups"] = T, S, H, G
    p["head_dim"], p["state_dim"] = P, N
    bufs = {
        "x": to_device(x, dtype),
        "dt": dt.astype(np.float32),
        "a": A.astype(np.float32),
        "b": to_device(B, dtype),
        "c": to_device(C, dtype),
        "d": D.astype(np.float32),
        "state": state.astype(np.float32),
        "cu_seqlens": cu_seqlens.astype(np.int32),
    }
    outputs = {"out": (x.shape, dtype), "state_out": (state.shape, "f32")}
    return _single_launch("mamba2_scan", launch, M2_BUF, p, bufs, outputs, kernel_dir)


# --------------------------------------------------------------------------------------------
# MLA: mla_attention and mla_reshape_and_cache
# --------------------------------------------------------------------------------------------


def mla_attention(
    query: np.ndarray,
    latent_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    cu_seqlens_q: np.ndarray,
    *,
    scale: float,
    value_dim: int,
    dtype: str,
    kernel_dir: Path = KERNEL_DIR,
) -> np.ndarray:
    """Run the mla_attention instance the host plans; float32 in (representable in dtype),
    float32 [T, H, value_dim] out (starts as NaN: rows the kernel leaves out show)."""
    T, H, D = query.shape
    nb, bs, _ = latent_cache.shape
    launch = native().select_mla_attention_kernel(dtype, H, D, value_dim, T)
    p = np.zeros((), MLA_PARAMS)
    p["num_tokens"], p["num_seqs"], p["num_heads"] = T, len(seq_lens), H
    p["num_blocks"], p["block_size"] = nb, bs
    p["max_blocks_per_seq"] = block_tables.shape[1]
    p["q_stride_token"], p["q_stride_head"] = H * D, D
    p["cache_stride_block"], p["cache_stride_slot"] = bs * D, D
    p["scale"] = scale
    bufs = {
        "query": to_device(query, dtype),
        "latent_cache": to_device(latent_cache, dtype),
        "block_tables": block_tables.astype(np.int32),
        "seq_lens": seq_lens.astype(np.int32),
        "cu_seqlens_q": cu_seqlens_q.astype(np.int32),
    }
    outputs = {"out": ((T, H, value_dim), dtype)}
    return _single_launch("mla_attention", launch, MLA_BUF, p, bufs, outputs, kernel_dir)[0]


def mla_reshape_and_cache(
    latent: np.ndarray,
    latent_cache: np.ndarray,
    slot_mapping: np.ndarray,
    dtype: str,
    kernel_dir: Path = KERNEL_DIR,
) -> np.ndarray:
    """Run mla_reshape_and_cache_<dtype>; float32 in (representable in dtype), float32 out."""
    T, D = latent.shape
    nb, bs, _ = latent_cache.shape
    launch = native().select_mla_reshape_and_cache_kernel(dtype, D, T)
    p = np.zeros((), MLC_PARAMS)
    p["num_tokens"], p["latent_dim"], p["num_slots"] = T, D, nb * bs
    p["latent_stride_token"] = D
    p["cache_stride_block"], p["cache_stride_slot"] = bs * D, D
    p["block_size"] = bs
    bufs = {
        "latent": to_device(latent, dtype),
        "latent_cache": to_device(latent_cache, dtype),
        "slot_mapping": slot_mapping.astype(np.int64),
    }
    binds: dict[int, harness.BufferArg] = {i: n for n, i in MLC_BUF.items() if n != "params"}
    binds[MLC_BUF["params"]] = np.frombuffer(p.tobytes(), np.uint8)
    d = harness.Dispatch(launch["kernel"], tuple(launch["grid"]), (launch["threads"], 1, 1), binds)
    r = harness.run(
        program(FAMILY_SOURCE["mla_reshape_and_cache"], kernel_dir),
        bufs,
        [d],
        ["latent_cache"],
    )
    return from_device(r["latent_cache"], dtype)


# --------------------------------------------------------------------------------------------
# rotary_embedding (query and key read through their strides)
# --------------------------------------------------------------------------------------------


def _view_of(x: np.ndarray) -> tuple[np.ndarray, int, tuple[int, ...]]:
    """The C-contiguous array a view `x` looks into (flattened), the view's first element's offset
    in it and the view's strides, in elements."""
    base = x
    while isinstance(base.base, np.ndarray):
        base = base.base
    assert base.flags.c_contiguous and base.dtype == x.dtype == np.float32
    start = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return base.reshape(-1), start // x.itemsize, tuple(s // x.itemsize for s in x.strides)


def rotary_embedding(
    positions: np.ndarray,
    query: np.ndarray,
    key: np.ndarray,
    cos_sin_cache: np.ndarray,
    is_neox: bool,
    dtype: str,
    cache_dtype: str | None = None,
    kernel_dir: Path = KERNEL_DIR,
) -> tuple[np.ndarray, np.ndarray]:
    """Run the rotary_embedding instance the host plans; float32 in (representable in the
    dtypes), float32 out. ``query`` and ``key`` may be views (e.g. of a fused QKV buffer): the
    array they look into is bound at their offset and read through their strides. The outputs
    start as NaN (elements the kernel leaves out show)."""
    cache_dtype = cache_dtype or dtype
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    P, R = cos_sin_cache.shape
    pos_tag = {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}[positions.dtype]
    launch = native().select_rotary_embedding_kernel(dtype, cache_dtype, pos_tag, T, Hq + Hkv, D)
    p = np.zeros((), ROPE_PARAMS)
    p["num_tokens"], p["num_q_heads"], p["num_kv_heads"], p["head_size"] = T, Hq, Hkv, D
    p["rotary_dim"], p["max_position"], p["is_neox"] = R, P, int(is_neox)
    q_base, q_off, q_strides = _view_of(query)
    k_base, k_off, k_strides = _view_of(key)
    p["q_stride_token"], p["q_stride_head"], p["q_stride_dim"] = q_strides
    p["k_stride_token"], p["k_stride_head"], p["k_stride_dim"] = k_strides
    bufs = {
        "positions": positions,
        "query": to_device(q_base, dtype),
        "key": to_device(k_base, dtype),
        "cos_sin_cache": to_device(cos_sin_cache, cache_dtype),
        "query_out": to_device(np.full(query.shape, np.nan, np.float32), dtype),
        "key_out": to_device(np.full(key.shape, np.nan, np.float32), dtype),
    }
    binds: dict[int, harness.BufferArg] = {i: n for n, i in ROPE_BUF.items() if n != "params"}
    binds[ROPE_BUF["query"]] = ("query", q_off * bufs["query"].itemsize)
    binds[ROPE_BUF["key"]] = ("key", k_off * bufs["key"].itemsize)
    binds[ROPE_BUF["params"]] = np.frombuffer(p.tobytes(), np.uint8)
    d = harness.Dispatch(launch["kernel"], tuple(launch["grid"]), (launch["threads"], 1, 1), binds)
    r = harness.run(
        program(FAMILY_SOURCE["rotary_embedding"], kernel_dir), bufs, [d], ["query_out", "key_out"]
    )
    return from_device(r["query_out"], dtype), from_device(r["key_out"], dtype)


# --------------------------------------------------------------------------------------------
# paged attention
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionCase:
    """Inputs of one paged-attention call (float32 values already rounded to `dtype`)."""

    dtype: str
    query: np.ndarray  # [T, Hq, D] (a view into `qkv` when fused_qkv)
    key_cache: np.ndarray  # [num_blocks, block_size, Hkv, D]
    value_cache: np.ndarray
    block_tables: np.ndarray  # int32 [S, max_blocks]
    seq_lens: np.ndarray  # int32 [S]
    cu_seqlens_q: np.ndarray  # int32 [S + 1]
    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: np.ndarray | None = None
    qkv: np.ndarray | None = None  # fused [T, Hq + 2 Hkv, D] buffer the query is a view of
    # fp8 pools: key_cache / value_cache hold uint8 bytes of this format, read times the scales;
    # per-token-head pools: uint8 rows of D bytes and their scale [..., Hkv, D + 4].
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0
    v_scale: float = 1.0


def host_plan(
    case: AttentionCase, *, supports_nax: bool = False, gpu_cores: int | None = None
) -> list[dict]:
    """The launches the host would encode for this call (vllm_metal._C's choice rules)."""
    Hq, D = case.query.shape[1:]
    return native().select_paged_attention_kernel(
        case.dtype,
        Hq,
        case.key_cache.shape[2],
        D,
        case.key_cache.shape[1],
        case.cu_seqlens_q.tolist(),
        case.seq_lens.tolist(),
        case.sliding_window or 0,
        supports_nax,
        gpu_cores or constant("DEFAULT_GPU_CORES"),
        case.kv_cache_dtype,
    )["launches"]


def split_partitions(launch: dict, case: AttentionCase, partition_size: int) -> dict:
    """A decode/gqa launch re-planned with split-KV partitions of `partition_size` keys, computed
    as the kernels document it (partitions start at the first attended key rounded down to the
    partition alignment)."""
    align = constant("PARTITION_ALIGN")
    assert launch["family"] in ("decode", "gqa")
    assert partition_size % align == 0 and partition_size % launch["kernel_block"] == 0
    W = case.sliding_window or 0
    offsets, max_parts = [0], 1
    for s in launch["work"]:
        L = int(case.seq_lens[s])
        lo = max(0, L - W) if W else 0
        base = lo - lo % align
        parts = max(1, math.ceil((L - base) / partition_size))
        max_parts = max(max_parts, parts)
        offsets.append(offsets[-1] + parts)
    Hq = case.query.shape[1]
    Hkv = case.key_cache.shape[2]
    G = Hq // Hkv
    rows = constant("GQA_ROWS")
    scratch = Hkv * math.ceil(G / rows) * rows if launch["family"] == "gqa" else Hq
    return dict(
        launch,
        partition_size=partition_size,
        part_offsets=offsets,
        total_partitions=offsets[-1],
        scratch_heads=scratch,
        grid=[launch["grid"][0], launch["grid"][1], max_parts],
        reduce_kernel=f"paged_attention_reduce_{case.dtype}_d{case.query.shape[2]}",
        reduce_grid=[Hq, len(launch["work"]), 1],
        reduce_threads=constant("DECODE_THREADS"),
    )


def with_kernel(launch: dict, kernel: str, kernel_block: int) -> dict:
    """The same launch with another instance of its family (e.g. another kernel block)."""
    return dict(launch, kernel=kernel, kernel_block=kernel_block)


def paged_attention(
    case: AttentionCase, launches: list[dict], kernel_dir: Path = KERNEL_DIR
) -> np.ndarray:
    """Run the launches in order on one output buffer; float32 [T, Hq, D]."""
    dt = case.dtype
    T, Hq, D = case.query.shape
    nb, bs, Hkv, W = case.key_cache.shape
    p = np.zeros((), PA_PARAMS)
    p["num_seqs"], p["num_q_heads"], p["num_kv_heads"] = len(case.seq_lens), Hq, Hkv
    p["num_blocks"], p["block_size"] = nb, bs
    p["max_blocks_per_seq"] = case.block_tables.shape[1]
    if case.qkv is not None:
        p["q_stride_token"], p["q_stride_head"] = case.qkv.shape[1] * D, D
        query_buf = to_device(case.qkv, dt)
    else:
        p["q_stride_token"], p["q_stride_head"] = Hq * D, D
        query_buf = to_device(case.query, dt)
    p["kv_stride_block"], p["kv_stride_slot"], p["kv_stride_head"] = bs * Hkv * W, Hkv * W, W
    p["head_dim"] = D
    p["scale"] = case.scale
    p["softcap"] = case.softcap or 0.0
    p["sliding_window"] = case.sliding_window or 0
    p["has_sinks"] = int(case.sinks is not None)
    p["kv_format"] = kv_format(case.kv_cache_dtype)
    p["k_scale"], p["v_scale"] = case.k_scale, case.v_scale
    pool_dtype = dt if case.kv_cache_dtype == "auto" else "u8"
    nan_out = np.full((T, Hq, D), np.nan, np.float32)
    out = to_device(nan_out, dt)  # rows no launch writes stay NaN
    base = {
        "query": query_buf,
        "key_cache": pool_to_device(case.key_cache, pool_dtype),
        "value_cache": pool_to_device(case.value_cache, pool_dtype),
        "block_tables": case.block_tables.astype(np.int32),
        "seq_lens": case.seq_lens.astype(np.int32),
        "cu_seqlens_q": case.cu_seqlens_q.astype(np.int32),
        "sinks": (case.sinks if case.sinks is not None else np.zeros(1)).astype(np.float32),
    }
    for launch in launches:
        lp = p.copy()
        fam = launch["family"]
        work = np.asarray(launch["work"], np.int32)
        lp["num_work"] = len(work) // 2 if fam in ("prefill", "nax") else len(work)
        lp["partition_size"] = launch["partition_size"]
        lp["scratch_heads"] = launch["scratch_heads"]
        split = launch["partition_size"] > 0
        nparts = max(1, launch["total_partitions"])
        scratch = max(1, launch["scratch_heads"])
        bufs = dict(base, out=out, work=work)
        bufs["part_offsets"] = np.asarray(launch["part_offsets"] or [0], np.int32)
        bufs["partial_ml"] = np.full((nparts * scratch, 2), np.nan, np.float32)
        bufs["partial_out"] = np.full((nparts * scratch, D), np.nan, np.float32)
        params = np.frombuffer(lp.tobytes(), np.uint8)
        binds: dict[int, harness.BufferArg] = {i: n for n, i in BUF.items() if n != "params"}
        binds[BUF["params"]] = params
        dispatches = [
            harness.Dispatch(
                launch["kernel"], tuple(launch["grid"]), (launch["threads"], 1, 1), binds
            )
        ]
        if split:
            dispatches.append(
                harness.Dispatch(
                    launch["reduce_kernel"],
                    tuple(launch["reduce_grid"]),
                    (launch["reduce_threads"], 1, 1),
                    binds,
                )
            )
        # The reduce kernel lives in the decode source: run each dispatch with the program that
        # has it, carrying the buffers across.
        outputs = ["out", "partial_ml", "partial_out"]
        for dsp in dispatches:
            prog = program(FAMILY_SOURCE[fam], kernel_dir)
            if dsp.kernel not in prog.instances:
                prog = program(FAMILY_SOURCE["reduce"], kernel_dir)
            res = harness.run(prog, bufs, [dsp], outputs)
            bufs.update(res)
        out = bufs["out"]
    return from_device(out, dt)


def make_case(
    *,
    dtype: str,
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
    fused_qkv: bool = False,
    seed: int = 0,
) -> AttentionCase:
    """Random inputs with shuffled block tables (every sequence's blocks scattered in the pool)."""
    from .oracle import quantize

    rng = np.random.default_rng(seed)
    assert all(q <= s for q, s in zip(q_lens, seq_lens))
    S, T = len(seq_lens), sum(q_lens)
    max_blocks = max(math.ceil(s / block_size) for s in seq_lens)
    num_blocks = S * max_blocks + 3
    perm = rng.permutation(num_blocks)
    block_tables = perm[: S * max_blocks].reshape(S, max_blocks).astype(np.int32)
    kv_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = quantize(rng.standard_normal(kv_shape), dtype)
    value_cache = quantize(rng.standard_normal(kv_shape), dtype)
    Hq = num_q_heads
    qkv = None
    if fused_qkv:
        qkv = quantize(rng.standard_normal((T, Hq + 2 * num_kv_heads, head_dim)), dtype)
        query = qkv[:, :Hq]
    else:
        query = quantize(rng.standard_normal((T, Hq, head_dim)), dtype)
    return AttentionCase(
        dtype=dtype,
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=np.asarray(seq_lens, np.int32),
        cu_seqlens_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        scale=1.0 / math.sqrt(head_dim) * 1.5,
        sliding_window=sliding_window,
        softcap=softcap,
        sinks=(rng.standard_normal(Hq) * 2).astype(np.float32) if sinks else None,
        qkv=qkv,
    )


def reference(case: AttentionCase) -> np.ndarray:
    """vllm_metal.ops.reference.paged_attention on the case (float32 inputs, float32 out)."""
    import mlx.core as mx

    from vllm_metal.ops import reference as ref

    out = ref.paged_attention(
        mx.array(np.ascontiguousarray(case.query)),
        mx.array(case.key_cache),
        mx.array(case.value_cache),
        mx.array(case.block_tables),
        mx.array(case.seq_lens),
        mx.array(case.cu_seqlens_q),
        scale=case.scale,
        sliding_window=case.sliding_window,
        softcap=case.softcap,
        sinks=mx.array(case.sinks) if case.sinks is not None else None,
    )
    return np.array(out.astype(mx.float32))
