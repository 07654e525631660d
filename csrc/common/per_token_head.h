// The per-token-head KV formats (VM_PTH_FORMATS of constants.h) as the kernels store and load
// them, in C++20 and Metal Shading Language at once: the C++ CPU bodies (ops/cache/cpu.cpp,
// ops/attention/cpu_fp8.h) and the Metal kernels (metal_kernels/attention/common.h,
// cache/reshape_and_cache.metal) include this one statement.
//
// The rules are vllm_metal/ops/per_token_head.py's (vLLM's KVQuantMode.*_PER_TOKEN_HEAD): a
// (token, KV head) row of head_dim elements gets scale = max(absmax / top, VM_PTH_MIN_SCALE) (top
// 127 for int8, E4M3's largest finite value for fp8); an element x stores x * (1 / scale), int8
// rounded half away from zero and clamped to [-128, 127], fp8 clamped to +-top and rounded to the
// nearest E4M3 byte (common/fp8.h). The row's bytes are its elements, then the scale's four
// little-endian bytes. An element reads as value(byte) * scale.
//
// int4 rows arrive already rotated (the rotation stays in MLX: ops/per_token_head.py) and are
// asymmetric: scale = max((max - min) / 15, VM_PTH_MIN_SCALE), zero point zp = round(-min / scale)
// clamped to [0, 15], an element x stores the level round(x * (1 / scale) + zp) clamped to
// [0, 15] (both rounded half away from zero), element 2i in the low nibble of byte i and 2i + 1 in
// the high one (head_dim / 2 bytes). The stored scale carries zp in its low four mantissa bits. An
// element reads as (level - zp) * scale', scale' the stored scale with those bits cleared.
#pragma once

#include "common/fp8.h"
#include "constants.h"

// vLLM's floor of a row's scale (the same number as ops/per_token_head.py's MIN_SCALE).
#define VM_PTH_MIN_SCALE 1e-6f

// A correctly rounded float32 division (Metal's `/` is approximate under its default fast math).
#if defined(__METAL_VERSION__)
#define VM_PTH_DIV_(a, b) metal::precise::divide(a, b)
#else
#define VM_PTH_DIV_(a, b) ((a) / (b))
#endif

#define VM_PTH_ID_(NAME, ID, ...) VM_PTH_ID_##NAME = ID,
enum VmPthFormat { VM_PTH_FORMATS(VM_PTH_ID_, ) };
#undef VM_PTH_ID_
// The fp8 format of fp8_per_token_head's elements.
#define VM_PTH_FP8_ELEMENT 1  // fp8_e4m3 of VM_FP8_FORMATS

// Whether kv_format names a per-token-head format (else: the query's dtype or per-tensor fp8).
VM_FP8_FN_ bool vm_pth_is(int kv_format) {
  return kv_format == VM_PTH_ID_int8_per_token_head || kv_format == VM_PTH_ID_fp8_per_token_head ||
         kv_format == VM_PTH_ID_int4_per_token_head;
}

// Whether a per-token-head format packs two elements a byte (int4: nibbles, asymmetric).
VM_FP8_FN_ bool vm_pth_int4(int kv_format) { return kv_format == VM_PTH_ID_int4_per_token_head; }

// Bytes of a row's elements: the scale's four bytes follow them.
VM_FP8_FN_ int vm_pth_data_bytes(int head_dim, int kv_format) {
  return vm_pth_int4(kv_format) ? head_dim / 2 : head_dim;
}

// The largest stored magnitude of a format: a row's absmax maps to it.
VM_FP8_FN_ float vm_pth_top(int kv_format) {
  return kv_format == VM_PTH_ID_int8_per_token_head
             ? 127.0f
             : vm_fp8_format(VM_PTH_FP8_ELEMENT).max_finite;
}

// The scale of a row whose largest magnitude is `absmax`.
VM_FP8_FN_ float vm_pth_scale_of(float absmax, int kv_format) {
  const float s = VM_PTH_DIV_(absmax, vm_pth_top(kv_format));
  return s > VM_PTH_MIN_SCALE ? s : VM_PTH_MIN_SCALE;
}

// The inverse of a row's scale, as the store multiplies by it.
VM_FP8_FN_ float vm_pth_inverse(float scale) { return VM_PTH_DIV_(1.0f, scale); }

// The byte that stores element x of a row with inverse scale `inv` (vm_pth_inverse).
VM_FP8_FN_ vm_u32 vm_pth_store(float x, float inv, int kv_format) {
  const float q = x * inv;  // its own statement: never fused with the rounding's addition
  if (kv_format == VM_PTH_ID_int8_per_token_head) {
    float r = q >= 0.0f ? q + 0.5f : q - 0.5f;
    r = r > 127.0f ? 127.0f : (r < -128.0f ? -128.0f : r);
    return vm_u32(int(r)) & 0xFFu;  // truncates toward zero
  }
  const float top = vm_pth_top(kv_format);
  return vm_fp8_from_float(q > top ? top : (q < -top ? -top : q), VM_PTH_FP8_ELEMENT);
}

// The unscaled value of a stored element byte.
VM_FP8_FN_ float vm_pth_element(vm_u32 code, int kv_format) {
  if (kv_format == VM_PTH_ID_int8_per_token_head) {
    return code >= 128u ? float(int(code) - 256) : float(code);
  }
  return vm_fp8_to_float(code, VM_PTH_FP8_ELEMENT);
}

// The row's scale from its four stored bytes (b0 first), and byte i of a scale to store.
VM_FP8_FN_ float vm_pth_scale(vm_u32 b0, vm_u32 b1, vm_u32 b2, vm_u32 b3) {
  return VM_BITS_FLOAT_(b0 | (b1 << 8) | (b2 << 16) | (b3 << 24));
}
VM_FP8_FN_ vm_u32 vm_pth_scale_byte(float scale, int i) {
  return (VM_FLOAT_BITS_(scale) >> (8 * i)) & 0xFFu;
}

// ---- int4: asymmetric levels, two a byte ------------------------------------------------------

// float32 x + -0.5 toward x's sign, then the conversion to an integer clamped to [0, 15] (the
// clamp first, so a huge x saturates as a GPU's conversion does).
VM_FP8_FN_ vm_u32 vm_pth_int4_level_(float x) {
  float r = x >= 0.0f ? x + 0.5f : x - 0.5f;
  r = r > 15.0f ? 15.0f : (r < 0.0f ? 0.0f : r);
  return vm_u32(int(r));
}

// The scale of a row whose smallest and largest elements are `low` and `high`.
VM_FP8_FN_ float vm_pth_int4_scale_of(float low, float high) {
  const float s = VM_PTH_DIV_(high - low, 15.0f);
  return s > VM_PTH_MIN_SCALE ? s : VM_PTH_MIN_SCALE;
}

// The zero point of a row with smallest element `low` and scale `scale`.
VM_FP8_FN_ vm_u32 vm_pth_int4_zero(float low, float scale) {
  return vm_pth_int4_level_(VM_PTH_DIV_(-low, scale));
}

// The level (0..15) that stores element x of a row with inverse scale `inv` and zero point `zp`.
VM_FP8_FN_ vm_u32 vm_pth_int4_store(float x, float inv, vm_u32 zp) {
  const float q = x * inv;  // its own statement: never fused with the additions below
  const float s = q + float(zp);
  return vm_pth_int4_level_(s);
}

// The stored scale: the scale's bits with the zero point in the low four.
VM_FP8_FN_ float vm_pth_int4_stored_scale(float scale, vm_u32 zp) {
  return VM_BITS_FLOAT_((VM_FLOAT_BITS_(scale) & 0xFFFFFFF0u) | (zp & 0xFu));
}

// Level d of a row from its packed byte d / 2 (even d: the low nibble).
VM_FP8_FN_ vm_u32 vm_pth_int4_level(vm_u32 byte, int d) {
  return (d & 1) ? byte >> 4 : byte & 0xFu;
}

// A stored int4 scale read back: the zero point (its low four bits) and scale' (them cleared).
VM_FP8_FN_ float vm_pth_int4_zp(float stored) { return float(VM_FLOAT_BITS_(stored) & 0xFu); }
VM_FP8_FN_ float vm_pth_int4_scale(float stored) {
  return VM_BITS_FLOAT_(VM_FLOAT_BITS_(stored) & 0xFFFFFFF0u);
}

// The value of level `level` of a row with zero point `zp` and scale' `scale`.
VM_FP8_FN_ float vm_pth_int4_value(vm_u32 level, float zp, float scale) {
  return (float(level) - zp) * scale;
}
