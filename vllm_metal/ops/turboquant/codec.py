"""TurboQuant slot bytes on MLX ops: what vLLM 0.32's TurboQuant store writes for one (token, KV
head), and what its decode kernel reads back.

A slot is ``[key | value data | value scale f16 | value zero f16 | pad to even]``. The plugin's
pools keep the key part and the rest apart (a key pool of `key_bytes` and a value pool of
`value_bytes` per slot), so a page holds exactly the bytes vLLM sizes.
- Keys, ``turboquant_k8v4``: fp8 E4M3 of the raw key (round to nearest even, saturated at 448).
- Keys, the ``_nc`` presets: the unit key ``k / (|k| + 1e-8)`` is rotated by the normalized
  Sylvester Hadamard matrix ``H``; each coordinate stores the index of its Lloyd-Max centroid
  (the count of centroid midpoints at or below it) in 3 or 4 bits, a little-endian bit stream,
  followed by ``|k|`` as float16. It reads back as ``|k| * c`` in the rotated space, ``c`` the
  centroid vector divided by ``sqrt(|c|^2 + 1e-16)`` (norm correction); attention then scores
  ``(q H) . (|k| c)``, which is ``q . k`` up to the quantization (``H`` is orthonormal and
  symmetric).
- Values: ``scale = max((max - min) / levels, 1e-8)`` and ``q = clip(floor((v - min) / scale +
  0.5), 0, levels)`` in float32 with 3 or 4 bits (levels 7 / 15), packed like key indices;
  ``scale`` and ``min`` stored as float16 and read as ``q * scale + min``.
Arithmetic is float32, as vLLM's kernels compute it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from vllm_metal.ops import fp8

_E4M3 = fp8.FORMATS["fp8_e4m3"]
FP8_KEY_BITS = 8  # a preset's key bits that mean fp8 keys


@dataclass(frozen=True)
class TurboQuantFormat:
    """One TurboQuant preset at one head size: bits of keys (8: fp8) and values, whether key
    centroids are renormalized, and the key centroid table (float32 values, ascending)."""

    name: str
    head_dim: int
    key_bits: int
    value_bits: int
    norm_correction: bool
    centroids: tuple[float, ...] = ()

    @property
    def fp8_keys(self) -> bool:
        return self.key_bits == FP8_KEY_BITS

    @property
    def key_bytes(self) -> int:
        """Bytes of a key: fp8 bytes, or packed indices plus the float16 norm."""
        if self.fp8_keys:
            return self.head_dim
        return math.ceil(self.head_dim * self.key_bits / 8) + 2

    @property
    def value_data_bytes(self) -> int:
        return math.ceil(self.head_dim * self.value_bits / 8)

    @property
    def slot_bytes(self) -> int:
        """vLLM's slot (``TurboQuantConfig.slot_size_aligned``): key, value data, scale and
        zero, rounded up to an even count."""
        raw = self.key_bytes + self.value_data_bytes + 4
        return raw + raw % 2

    @property
    def value_bytes(self) -> int:
        """Bytes of the value pool per slot: the slot past its key (pad byte included)."""
        return self.slot_bytes - self.key_bytes


@cache
def hadamard(head_dim: int) -> mx.array:
    """The normalized Sylvester Hadamard matrix ``[D, D]`` (float32), vLLM's rotation."""
    h = np.ones((1, 1))
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return mx.array((h / math.sqrt(head_dim)).astype(np.float32))


def _table(fmt: TurboQuantFormat) -> tuple[mx.array, mx.array]:
    c = np.asarray(fmt.centroids, np.float32)
    return mx.array(c), mx.array((c[:-1] + c[1:]) / np.float32(2))


def pack(indices: mx.array, bits: int) -> mx.array:
    """``[..., D]`` integers below ``2**bits`` -> little-endian bit stream ``[..., D*bits/8]``
    uint8 (bits 3 or 4; D a multiple of 8)."""
    lead, d = indices.shape[:-1], indices.shape[-1]
    q = indices.astype(mx.uint32)
    if bits == 4:
        pairs = q.reshape(*lead, d // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(mx.uint8)
    groups = q.reshape(*lead, d // 8, 8)
    word = (groups << (mx.arange(8, dtype=mx.uint32) * 3)).sum(-1)
    parts = [(word >> shift) & 0xFF for shift in (0, 8, 16)]
    return mx.stack(parts, axis=-1).reshape(*lead, d * 3 // 8).astype(mx.uint8)


def unpack(data: mx.array, bits: int, d: int) -> mx.array:
    """The inverse of `pack`: ``[..., D]`` uint32 indices."""
    lead = data.shape[:-1]
    b = data.astype(mx.uint32)
    if bits == 4:
        return mx.stack([b & 0xF, b >> 4], axis=-1).reshape(*lead, d)
    triples = b.reshape(*lead, d // 8, 3)
    word = triples[..., 0] | (triples[..., 1] << 8) | (triples[..., 2] << 16)
    return ((word[..., None] >> (mx.arange(8, dtype=mx.uint32) * 3)) & 7).reshape(*lead, d)


def _f16_bytes(x: mx.array) -> mx.array:
    """``[...]`` float32 -> ``[..., 2]`` bytes of its float16 (little-endian)."""
    return mx.view(x.astype(mx.float16)[..., None], mx.uint8)


def _f16_value(pair: mx.array) -> mx.array:
    """``[..., 2]`` bytes -> ``[...]`` float32 of the float16 they hold."""
    lo, hi = pair[..., 0].astype(mx.uint16), pair[..., 1].astype(mx.uint16)
    return mx.view(lo | (hi << 8), mx.float16).astype(mx.float32)


def rotate_keys(key: mx.array, fmt: TurboQuantFormat) -> tuple[mx.array, mx.array]:
    """MSE keys ``[..., D]`` -> (the unit keys rotated by ``hadamard`` ``[..., D]``, their norms
    ``[...]``), float32: what the stored indices and norm are taken from (the native write takes
    these and stores their bytes)."""
    k = key.astype(mx.float32)
    norm = mx.sqrt((k * k).sum(-1))
    return (k / (norm[..., None] + 1e-8)) @ hadamard(fmt.head_dim), norm


@cache
def centroid_table(fmt: TurboQuantFormat) -> mx.array:
    """The key centroids ``[2**key_bits]`` float32 (two zeros for fp8 keys, which read none)."""
    return _table(fmt)[0] if fmt.centroids else mx.zeros((2,), mx.float32)


def quantize_keys(key: mx.array, fmt: TurboQuantFormat) -> mx.array:
    """``[..., D]`` keys -> ``[..., key_bytes]`` uint8."""
    k = key.astype(mx.float32)
    if fmt.fp8_keys:
        return fp8.quantize(k, _E4M3, 1.0)
    rotated, norm = rotate_keys(k, fmt)
    _, midpoints = _table(fmt)
    index = (rotated[..., None] >= midpoints).astype(mx.uint32).sum(-1)
    return mx.concatenate([pack(index, fmt.key_bits), _f16_bytes(norm)], axis=-1)


def quantize_values(value: mx.array, fmt: TurboQuantFormat) -> mx.array:
    """``[..., D]`` values -> ``[..., value_bytes]`` uint8 (the pad byte zero)."""
    v = value.astype(mx.float32)
    levels = 2**fmt.value_bits - 1
    vmin, vmax = v.min(-1), v.max(-1)
    scale = (vmax - vmin) / levels
    scale = mx.where(scale > 1e-8, scale, 1e-8)
    q = mx.floor((v - vmin[..., None]) / scale[..., None] + 0.5)
    q = mx.clip(q, 0, levels).astype(mx.uint32)
    parts = [pack(q, fmt.value_bits), _f16_bytes(scale), _f16_bytes(vmin)]
    pad = fmt.value_bytes - fmt.value_data_bytes - 4
    if pad:
        parts.append(mx.zeros((*v.shape[:-1], pad), dtype=mx.uint8))
    return mx.concatenate(parts, axis=-1)


def _e4m3_values(codes: mx.array) -> mx.array:
    """float32 values of E4M3 bytes by their bits (elementwise; a table gather costs more on the
    CPU): normal ``(1 + m/8) * 2^(e-7)``, subnormal ``m * 2^-9``. The store never writes NaN
    codes but for NaN keys, which read here as 480 (0x7f is otherwise unused)."""
    b = codes.astype(mx.uint32)
    exponent, mantissa = (b >> 3) & 0xF, b & 0x7
    sign = (b & 0x80) << 24
    normal = mx.view(sign | ((exponent + 120) << 23) | (mantissa << 20), mx.float32)
    subnormal = mx.view(
        sign | mx.view(mantissa.astype(mx.float32) * 2.0**-9, mx.uint32), mx.float32
    )
    return mx.where(exponent == 0, subnormal, normal)


@cache
def _pair_table(fmt: TurboQuantFormat) -> mx.array:
    """``[256, 2]``: the centroids of a byte's low and high 4-bit indices."""
    c = np.asarray(fmt.centroids, np.float32)
    codes = np.arange(256)
    return mx.array(np.stack([c[codes & 0xF], c[codes >> 4]], axis=-1))


def dequantize_keys(data: mx.array, fmt: TurboQuantFormat) -> mx.array:
    """``[..., key_bytes]`` -> ``[..., D]`` float32 keys as attention scores them: fp8 keys as
    they are, MSE keys in the rotated space (score them with ``query @ hadamard``)."""
    if fmt.fp8_keys:
        return _e4m3_values(data)
    if fmt.key_bits == 4:  # two indices a byte: one gather of both centroids
        c = _pair_table(fmt)[data[..., :-2]].reshape(*data.shape[:-1], fmt.head_dim)
    else:
        centroids, _ = _table(fmt)
        c = centroids[unpack(data[..., :-2], fmt.key_bits, fmt.head_dim)]
    if fmt.norm_correction:
        c = c * (1.0 / mx.sqrt((c * c).sum(-1, keepdims=True) + 1e-16))
    return _f16_value(data[..., -2:])[..., None] * c


def dequantize_values(data: mx.array, fmt: TurboQuantFormat) -> mx.array:
    """``[..., value_bytes]`` -> ``[..., D]`` float32 values."""
    n = fmt.value_data_bytes
    q = unpack(data[..., :n], fmt.value_bits, fmt.head_dim).astype(mx.float32)
    scale, zero = _f16_value(data[..., n : n + 2]), _f16_value(data[..., n + 2 : n + 4])
    return q * scale[..., None] + zero[..., None]


def scoring_space(x: mx.array, fmt: TurboQuantFormat) -> mx.array:
    """Queries (or unquantized keys) ``[..., D]`` in float32 in the space `dequantize_keys`
    returns keys in: rotated by ``hadamard`` for MSE keys."""
    x = x.astype(mx.float32)
    return x if fmt.fp8_keys else x @ hadamard(fmt.head_dim)
