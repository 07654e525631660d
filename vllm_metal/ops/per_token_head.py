"""Per-token-head quantized KV storage: ``--kv-cache-dtype int8_per_token_head`` /
``fp8_per_token_head`` / ``int4_per_token_head``, with vLLM 0.32's semantics
(``KVQuantMode.*_PER_TOKEN_HEAD``, its Triton cache write and attention).

Every (token, KV head) row of ``D`` elements gets its own float32 scale, computed as the row is
written. A pool row is ``D`` data bytes (``D / 2`` for int4) followed by the scale's four bytes
(little-endian float32), so a pool is ``uint8 [num_blocks, block_size, Hkv, row_bytes]``: the
page vLLM sizes (data plus one scale per K/V side and head, `TritonAttentionBackend
.customize_spec`), with K and V in their own arrays as in every pool here.

- int8: ``scale = max(absmax / 127, 1e-6)``; ``q = x * (1 / scale)``, ``+-0.5`` (half away from
  zero), clamped to [-128, 127], truncated. Reads ``q * scale``.
- fp8 (E4M3, ``ops.fp8``): ``scale = max(absmax / 448, 1e-6)``; ``x * (1 / scale)`` clamped to
  +-448, rounded to nearest even. Reads ``value(byte) * scale``.
- int4: the row is first rotated, ``H(signs * x)`` (an unnormalized Walsh-Hadamard transform in
  blocks of ``b``, the largest power of two dividing ``D``, after a fixed +-1 sign vector) and
  rounded to the row dtype; then asymmetric: ``scale = max((max - min) / 15, 1e-6)``, zero point
  ``zp = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(x * (1 / scale) + zp), 0, 15)``
  (rounding half away from zero), element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in
  the high one. The zero point lives in the low four mantissa bits of the stored scale. Reads
  ``(q - zp) * scale'`` (``scale'`` the stored bits with those four cleared) in the rotated
  space: attention rotates the query the same way, divides the softmax scale by ``b``, and
  rotates the output back (``signs * H(out) / b``).

Arithmetic is float32 in the order stated (a division, then a multiply by the reciprocal), as
vLLM's kernels write it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _header, fp8

_CONSTANTS = _header.header_constants()
KV_CACHE_DTYPES = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
# The formats the native ops take (csrc/constants.h's VM_PTH_FORMATS; csrc/common/per_token_head.h
# states their store and load for the C++ bodies and the Metal kernels).
NATIVE_KV_CACHE_DTYPES = tuple(name for name, _id in _CONSTANTS["PTH_FORMATS"])
SCALE_BYTES = _CONSTANTS["PTH_SCALE_BYTES"]  # one float32 per (token, KV head) row
MIN_SCALE = 1e-6  # VM_PTH_MIN_SCALE of csrc/common/per_token_head.h (the native ops' bytes agree)
INT8_MAX, INT8_MIN = 127.0, -128.0
INT4_LEVELS = 15.0
FP8 = fp8.FORMATS["fp8_e4m3"]
# vLLM's seed of the int4 rotation's sign vector (`int4_per_token_head._get_rht_signs`, round 0).
RHT_SEED = 0x9E3779B9


def is_per_token_head(kv_cache_dtype: object) -> bool:
    return kv_cache_dtype in KV_CACHE_DTYPES


def data_bytes(kv_cache_dtype: str, head_size: int) -> int:
    """Bytes of one row's elements (two int4 elements share a byte)."""
    return head_size // 2 if kv_cache_dtype == "int4_per_token_head" else head_size


def row_bytes(kv_cache_dtype: str, head_size: int) -> int:
    """Bytes of one stored (token, KV head) row: its elements and its scale."""
    return data_bytes(kv_cache_dtype, head_size) + SCALE_BYTES


def rotation_block(head_size: int) -> int:
    """``b``, the largest power of two dividing ``head_size`` (the int4 rotation's block)."""
    return head_size & -head_size


_SIGNS: dict[int, mx.array] = {}


def rht_signs(block: int) -> mx.array:
    """float32 ``[block]`` of +-1: vLLM's sign vector (a Bernoulli(0.5) draw of torch's CPU
    generator seeded with ``RHT_SEED``)."""
    signs = _SIGNS.get(block)
    if signs is None:
        import torch

        gen = torch.Generator(device="cpu")
        gen.manual_seed(RHT_SEED)
        draw = torch.bernoulli(torch.full((block,), 0.5), generator=gen)
        signs = _SIGNS[block] = mx.array((2.0 * draw - 1.0).numpy().astype(np.float32))
    return signs


def hadamard(x: mx.array) -> mx.array:
    """The unnormalized Walsh-Hadamard transform over the last axis (a power of two), as the
    butterfly of vLLM's CPU path computes it (float32 sums in that order)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: mx.array, inverse: bool = False) -> mx.array:
    """float32 ``H(signs * x)`` (``inverse``: ``signs * H(x)``) in blocks of `rotation_block`."""
    d = x.shape[-1]
    b = rotation_block(d)
    blocks = x.astype(mx.float32).reshape(*x.shape[:-1], d // b, b)
    signs = rht_signs(b)
    out = hadamard(blocks) * signs if inverse else hadamard(blocks * signs)
    return out.reshape(x.shape)


def _round_half_away(x: mx.array) -> mx.array:
    """float32 ``x +- 0.5`` toward x's sign (one float32 rounding), as float32."""
    return mx.where(x >= 0, x + 0.5, x - 0.5)


def _scale_bytes(scale: mx.array) -> mx.array:
    """float32 ``[..., 1]`` -> its four bytes ``[..., 4]``."""
    return mx.view(scale.astype(mx.float32), mx.uint8)


def quantize(x: mx.array, kv_cache_dtype: str) -> mx.array:
    """Rows ``[..., D]`` (any float dtype) -> stored rows ``uint8 [..., row_bytes]``."""
    if kv_cache_dtype == "int4_per_token_head":
        return _quantize_int4(x)
    a = x.astype(mx.float32)
    top = INT8_MAX if kv_cache_dtype == "int8_per_token_head" else FP8.max_finite
    scale = mx.maximum(mx.max(mx.abs(a), axis=-1, keepdims=True) / top, MIN_SCALE)
    q = a * (1.0 / scale)
    if kv_cache_dtype == "int8_per_token_head":
        q = mx.clip(_round_half_away(q), INT8_MIN, INT8_MAX)
        codes = mx.view(q.astype(mx.int32).astype(mx.int8), mx.uint8)  # truncates toward zero
    else:
        codes = fp8.quantize(mx.clip(q, -top, top), FP8, 1.0)
    return mx.concatenate([codes, _scale_bytes(scale)], axis=-1)


def rotated_rows(x: mx.array) -> mx.array:
    """int4's rows as its store quantizes them: rotated and rounded to the rows' dtype (what the
    native write op receives)."""
    return rotate(x).astype(x.dtype)


def _quantize_int4(x: mx.array) -> mx.array:
    a = rotated_rows(x).astype(mx.float32)
    low, high = mx.min(a, axis=-1, keepdims=True), mx.max(a, axis=-1, keepdims=True)
    scale = mx.maximum((high - low) / INT4_LEVELS, MIN_SCALE)
    zp = mx.clip(_round_half_away(-low / scale).astype(mx.int32), 0, 15)
    s = a * (1.0 / scale) + zp.astype(mx.float32)
    q = mx.clip(_round_half_away(s).astype(mx.int32), 0, 15).astype(mx.uint8)
    pairs = q.reshape(*q.shape[:-1], q.shape[-1] // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    bits = (mx.view(scale, mx.uint32) & 0xFFFFFFF0) | zp.astype(mx.uint32)
    return mx.concatenate([packed, mx.view(bits, mx.uint8)], axis=-1)


def dequantize(rows: mx.array, kv_cache_dtype: str, dtype: mx.Dtype) -> mx.array:
    """Stored rows ``uint8 [..., row_bytes]`` -> values ``[..., D]`` in ``dtype`` (int4: in the
    rotated space)."""
    n = rows.shape[-1] - SCALE_BYTES
    data = rows[..., :n]
    scale = mx.view(rows[..., n:], mx.float32)  # [..., 1]
    if kv_cache_dtype == "int8_per_token_head":
        values = mx.view(data, mx.int8).astype(mx.float32) * scale
    elif kv_cache_dtype == "fp8_per_token_head":
        values = fp8.dequantize(data, FP8, 1.0, mx.float32) * scale
    else:
        nibbles = mx.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], 2 * n)
        bits = mx.view(scale, mx.uint32)
        zp = (bits & 0xF).astype(mx.float32)
        values = (nibbles.astype(mx.float32) - zp) * mx.view(bits & 0xFFFFFFF0, mx.float32)
    return values.astype(dtype)


@dataclass(frozen=True)
class PerTokenHeadQuant:
    """How a layer's per-token-head pools are written and read (the same for every layer: the
    scales are in the pages)."""

    kv_cache_dtype: str

    @property
    def rotated(self) -> bool:
        """Whether attention runs in the rotated space (int4)."""
        return self.kv_cache_dtype == "int4_per_token_head"

    @property
    def native(self) -> bool:
        """Whether the native ops (C++ CPU bodies, Metal kernels) write and read these pools (all
        three formats; int4's rotation stays in MLX: `stored_rows`, and attention's own)."""
        return self.kv_cache_dtype in NATIVE_KV_CACHE_DTYPES

    def stored_rows(self, rows: mx.array) -> mx.array:
        """The rows the native write op quantizes: int4's rotated (`rotated_rows`), the others as
        they are."""
        return rotated_rows(rows) if self.rotated else rows

    def row_bytes(self, head_size: int) -> int:
        return row_bytes(self.kv_cache_dtype, head_size)

    def quantize(self, rows: mx.array) -> mx.array:
        return quantize(rows, self.kv_cache_dtype)

    def keys(self, rows: mx.array, dtype: mx.Dtype) -> mx.array:
        return dequantize(rows, self.kv_cache_dtype, dtype)

    values = keys

    def options(self) -> dict[str, object]:
        """The paged ops' keyword arguments that select this storage."""
        return {"kv_cache_dtype": self.kv_cache_dtype}


def kv_quant(kv_cache_dtype: object) -> PerTokenHeadQuant | None:
    return PerTokenHeadQuant(kv_cache_dtype) if is_per_token_head(kv_cache_dtype) else None
