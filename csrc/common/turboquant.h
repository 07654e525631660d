// The TurboQuant KV slots (--kv-cache-dtype turboquant_*) as the kernels store and load them, in
// C++20 and Metal Shading Language at once: the C++ CPU bodies (ops/turboquant/cpu.cpp) and the
// Metal kernels (metal_kernels/turboquant/) include this one statement.
//
// The rules are vllm_metal/ops/turboquant/codec.py's (vLLM 0.32's triton_turboquant_store.py and
// triton_turboquant_decode.py). Per (token, KV head) a key pool row and a value pool row:
// - key, fp8 (key_bits 8): head_dim E4M3 bytes of the raw key (common/fp8.h, scale 1).
// - key, MSE (key_bits 3 / 4): the key's Hadamard-rotated unit vector (rotated in MLX before the
//   op) stores, per element, the index of its Lloyd-Max centroid: the count of centroid midpoints
//   (c[j] + c[j + 1]) / 2 at or below it, packed (vm_tq_index), then |k| as float16 (two
//   little-endian bytes). It reads back as |k| * c[index] * n, n = 1 / sqrt(sum c[index]^2 +
//   VM_TQ_CENTROID_EPS) with norm correction, else 1; the query is rotated the same way in MLX.
// - value (value_bits 3 / 4): levels = 2^bits - 1, scale = max((max - min) / levels,
//   VM_TQ_MIN_VALUE_SCALE), q = clamp(floor((v - min) / scale + 0.5), 0, levels) in float32,
//   packed like key indices, then scale and min as float16; a pad byte (zero) where vLLM's slot
//   is odd. It reads back as q * scale + min.
//
// Packing (stated once): element i of a row of b-bit fields (b = 3 or 4) occupies bits
// [i * b, i * b + b) of a little-endian bit stream: byte i * b / 8, from bit i * b % 8 up, and a
// 3-bit field starting at bit 6 or 7 of its byte continues in the next byte's low bits. Eight
// fields make b whole bytes, so rows (head_dim a multiple of 8) pack in groups of eight.
#pragma once

#include "common/fp8.h"
#include "constants.h"

// The norm correction's floor under a centroid vector's squared norm (vLLM's 1e-16).
#define VM_TQ_CENTROID_EPS 1e-16f
// The floor of a value row's scale (vLLM's 1e-8).
#define VM_TQ_MIN_VALUE_SCALE 1e-8f
// The fp8 format of fp8 keys (fp8_e4m3 of VM_FP8_FORMATS).
#define VM_TQ_FP8_KEY_FORMAT 1

#if defined(__METAL_VERSION__)
#define VM_TQ_FN_ inline
#define VM_TQ_DIV_(a, b) metal::precise::divide(a, b)
#define VM_TQ_FLOOR_(x) metal::floor(x)
#define VM_TQ_F16_BITS_(x) vm_u32(metal::as_type<ushort>(half(x)))
#define VM_TQ_F16_VALUE_(u) float(metal::as_type<half>(ushort(u)))
#else
#include "common/convert.h"
#define VM_TQ_FN_ static inline  // internal linkage: ISA builds keep their own copy
#define VM_TQ_DIV_(a, b) ((a) / (b))
#define VM_TQ_FLOOR_(x) __builtin_floorf(x)
#define VM_TQ_F16_BITS_(x) vm_u32(vllm_metal::cpu::float_to_half(x))
#define VM_TQ_F16_VALUE_(u) vllm_metal::cpu::half_to_float(uint16_t(u))
#endif

// Field i of a packed row of `bits`-bit fields (`data`: the row's first byte; any pointer type).
template <typename P>
VM_TQ_FN_ vm_u32 vm_tq_index(P data, int i, int bits) {
  const int bit = i * bits;
  const int shift = bit & 7;
  vm_u32 window = vm_u32(data[bit >> 3]);
  if (shift + bits > 8) {
    window |= vm_u32(data[(bit >> 3) + 1]) << 8;
  }
  return (window >> shift) & ((1u << bits) - 1u);
}

// Byte b (< bits) of a group of eight packed fields `idx[0..8)`.
template <typename P>
VM_TQ_FN_ vm_u32 vm_tq_group_byte(P idx, int b, int bits) {
  vm_u32 byte = 0;
  for (int i = 0; i < 8; ++i) {
    const int shift = i * bits - 8 * b;  // the field's first bit, relative to the byte's
    if (shift > -bits && shift < 8) {
      byte |= shift >= 0 ? idx[i] << shift : idx[i] >> (-shift);
    }
  }
  return byte & 0xFFu;
}

// The centroid index of a rotated unit key element x: midpoints at or below it (`centroids`: the
// 2^bits ascending centroids).
template <typename P>
VM_TQ_FN_ vm_u32 vm_tq_key_index(float x, P centroids, int bits) {
  vm_u32 index = 0;
  const int n = (1 << bits) - 1;
  for (int j = 0; j < n; ++j) {
    const float mid = (centroids[j] + centroids[j + 1]) * 0.5f;
    index += x >= mid ? 1u : 0u;
  }
  return index;
}

// The largest value index of `bits`-bit values.
VM_TQ_FN_ int vm_tq_levels(int bits) { return (1 << bits) - 1; }

// The scale of a value row spanning [vmin, vmax].
VM_TQ_FN_ float vm_tq_value_scale(float vmin, float vmax, int bits) {
  const float s = VM_TQ_DIV_(vmax - vmin, float(vm_tq_levels(bits)));
  return s > VM_TQ_MIN_VALUE_SCALE ? s : VM_TQ_MIN_VALUE_SCALE;
}

// The index a value element v stores in a row of (vmin, scale).
VM_TQ_FN_ vm_u32 vm_tq_value_index(float v, float vmin, float scale, int bits) {
  const float t = VM_TQ_DIV_(v - vmin, scale);  // its own statement: never fused with the + 0.5
  const float q = VM_TQ_FLOOR_(t + 0.5f);
  const float top = float(vm_tq_levels(bits));
  return vm_u32(q < 0.0f ? 0.0f : (q > top ? top : q));
}

// Stored float16 numbers: the two bytes of x, and the value of bytes (lo, hi).
VM_TQ_FN_ vm_u32 vm_tq_f16_byte(float x, int i) { return (VM_TQ_F16_BITS_(x) >> (8 * i)) & 0xFFu; }
VM_TQ_FN_ float vm_tq_f16(vm_u32 lo, vm_u32 hi) { return VM_TQ_F16_VALUE_(lo | (hi << 8)); }

// Bytes of a packed row of head_dim `bits`-bit fields; of an MSE key row (indices and norm).
VM_TQ_FN_ int vm_tq_packed_bytes(int head_dim, int bits) { return head_dim * bits / 8; }
VM_TQ_FN_ int vm_tq_key_bytes(int head_dim, int key_bits) {
  return key_bits == 8 ? head_dim : vm_tq_packed_bytes(head_dim, key_bits) + 2;
}

// A stored value row (`row`: its first byte): its scale and min, and the value of an index.
template <typename P>
VM_TQ_FN_ float vm_tq_row_scale(P row, int head_dim, int bits) {
  const int n = vm_tq_packed_bytes(head_dim, bits);
  return vm_tq_f16(vm_u32(row[n]), vm_u32(row[n + 1]));
}
template <typename P>
VM_TQ_FN_ float vm_tq_row_min(P row, int head_dim, int bits) {
  const int n = vm_tq_packed_bytes(head_dim, bits);
  return vm_tq_f16(vm_u32(row[n + 2]), vm_u32(row[n + 3]));
}
VM_TQ_FN_ float vm_tq_dequant(vm_u32 index, float scale, float vmin) {
  return float(index) * scale + vmin;
}
