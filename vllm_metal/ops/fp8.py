"""FP8 KV-cache storage: the byte formats of ``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``.

MLX has no fp8 dtype, so a quantized pool is ``uint8`` and these functions convert. The semantics
are vLLM's per-tensor FP8 KV cache (``KVQuantMode.FP8_PER_TENSOR``): a layer writes
``fp8(x / k_scale)`` (and ``v_scale`` for values), rounded to nearest with ties to even and
saturated to the largest finite value (so an overflow or infinity stores +-max, never Inf/NaN),
and attention reads ``float(byte) * scale``. ``fp8`` means ``fp8_e4m3``. E4M3 is the OCP "FN"
variant (no infinities, largest finite 448, 0x7f/0xff NaN); E5M2 is IEEE-like (largest finite
57344). A NaN input stores the format's NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from vllm_metal.ops import _header

# kv_cache_dtype -> the format it stores.
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True)
class Fp8Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_finite: float
    nan_code: int  # what a NaN input stores (sign bit clear)

    @property
    def min_exponent(self) -> int:
        """The exponent of the smallest normal value (subnormals share its quantum)."""
        return 1 - self.bias


def _formats() -> dict[str, Fp8Format]:
    """The formats as csrc/constants.h states them for the native kernels too (VM_FP8_FORMATS);
    read from the header itself, which _C's CONSTANTS equal (tests/ops/test_constants.py)."""
    constants = _header.header_constants()
    return {
        name: Fp8Format(name, 7 - m_bits, m_bits, bias, float(top), constants["FP8_NAN_CODE"])
        for name, _id, m_bits, bias, top, _finite_only in constants["FP8_FORMATS"]
    }


FORMATS = _formats()


def format_of(kv_cache_dtype: str) -> Fp8Format | None:
    """The fp8 format a kv_cache_dtype stores, or None for an unquantized one."""
    name = KV_CACHE_DTYPES.get(kv_cache_dtype)
    return None if name is None else FORMATS[name]


def decode_table(fmt: Fp8Format) -> np.ndarray:
    """float64 ``[256]``: the value of every byte of the format (NaN and Inf where it has them)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    mantissa = codes & ((1 << fmt.mantissa_bits) - 1)
    frac = mantissa / (1 << fmt.mantissa_bits)
    normal = (1.0 + frac) * np.exp2(exponent.astype(np.float64) - fmt.bias)
    subnormal = frac * np.exp2(float(fmt.min_exponent))
    values = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << fmt.exponent_bits) - 1
    if fmt.name == "fp8_e4m3":  # FN: only the all-ones mantissa of the top exponent is NaN
        values[top & (mantissa == (1 << fmt.mantissa_bits) - 1)] = np.nan
    else:  # IEEE: the top exponent is Inf (mantissa 0) or NaN
        values[top] = np.where(mantissa[top] == 0, sign[top] * np.inf, np.nan)
    return values


_TABLES: dict[str, mx.array] = {}


def _table(fmt: Fp8Format) -> mx.array:
    table = _TABLES.get(fmt.name)
    if table is None:
        table = _TABLES[fmt.name] = mx.array(decode_table(fmt).astype(np.float32))
    return table


def quantize(x: mx.array, fmt: Fp8Format, scale: float) -> mx.array:
    """``fp8(x / scale)`` as uint8 bytes, the shape of ``x`` (see the module docstring)."""
    a = x.astype(mx.float32) / scale
    magnitude = mx.minimum(mx.abs(a), fmt.max_finite)  # saturate (inf too)
    # The exponent of the magnitude's leading bit (float32 bits), at least the smallest normal's.
    bits = mx.view(magnitude, mx.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(mx.int32) - 127
    exponent = mx.maximum(exponent, fmt.min_exponent)
    quantum = mx.view(((exponent - fmt.mantissa_bits + 127) << 23).astype(mx.uint32), mx.float32)
    steps = mx.round(magnitude / quantum).astype(mx.int32)  # ties to even
    one = 1 << fmt.mantissa_bits
    carried = steps == 2 * one  # rounded up to the next power of two
    exponent = mx.where(carried, exponent + 1, exponent)
    steps = mx.where(carried, one, steps)
    normal = steps >= one
    biased = mx.where(normal, exponent + fmt.bias, 0)
    mantissa = mx.where(normal, steps - one, steps)
    code = (biased << fmt.mantissa_bits) | mantissa | mx.where(a < 0, 0x80, 0)
    code = mx.where(mx.isnan(a), fmt.nan_code, code)
    return code.astype(mx.uint8)


def dequantize(codes: mx.array, fmt: Fp8Format, scale: float, dtype: mx.Dtype) -> mx.array:
    """``float(byte) * scale`` in ``dtype`` for uint8 ``codes`` of the format."""
    values = _table(fmt)[codes]
    if scale != 1.0:
        values = values * scale
    return values.astype(dtype)


@dataclass(frozen=True)
class KVQuant:
    """How one layer's quantized pools are read: their format and its key and value scales."""

    fmt: Fp8Format
    k_scale: float = 1.0
    v_scale: float = 1.0

    def keys(self, codes: mx.array, dtype: mx.Dtype) -> mx.array:
        return dequantize(codes, self.fmt, self.k_scale, dtype)

    def values(self, codes: mx.array, dtype: mx.Dtype) -> mx.array:
        return dequantize(codes, self.fmt, self.v_scale, dtype)

    def options(self) -> dict[str, object]:
        """The paged ops' keyword arguments that select this storage."""
        return {"kv_cache_dtype": self.fmt.name, "k_scale": self.k_scale, "v_scale": self.v_scale}


def kv_quant(kv_cache_dtype: str, k_scale: float, v_scale: float) -> KVQuant | None:
    fmt = format_of(kv_cache_dtype)
    return None if fmt is None else KVQuant(fmt, float(k_scale), float(v_scale))
