// The fp8 KV element formats (VM_FP8_FORMATS of constants.h) as conversions between float32 and a
// byte, in C++20 and Metal Shading Language at once: the C++ CPU bodies and the Metal kernels
// (metal_kernels/attention/common.h, cache/reshape_and_cache.metal) include this one statement.
//
// The rules are vllm_metal/ops/fp8.py's (vLLM's per-tensor FP8 KV cache): a write stores the byte
// nearest to x / scale, ties to the even mantissa, saturated to the largest finite value (an
// overflow or an infinity stores +-max), a NaN stores VM_FP8_NAN_CODE, and -0 or a value that
// rounds to zero from below keeps its sign bit only when the value is negative; a read is the
// byte's value (Inf / NaN where the format has them). Integer arithmetic on the float32 bits only,
// so the result does not depend on a compiler's math mode.
#pragma once

#include "constants.h"

#if defined(__METAL_VERSION__)
typedef uint vm_u32;
#define VM_FP8_FN_ inline
#define VM_FLOAT_BITS_(x) metal::as_type<uint>(x)
#define VM_BITS_FLOAT_(u) metal::as_type<float>(u)
#else
#include <bit>
#include <cstdint>
typedef uint32_t vm_u32;
#define VM_FP8_FN_ static constexpr  // internal linkage: ISA builds keep their own copy
#define VM_FLOAT_BITS_(x) std::bit_cast<uint32_t>(x)
#define VM_BITS_FLOAT_(u) std::bit_cast<float>(u)
#endif

struct VmFp8Format {
  int mantissa_bits;
  int bias;
  float max_finite;
  bool finite_only;  // OCP "FN": no infinities, only S.1111.111 is NaN
};

// The format with id `kv_format` (an id of VM_FP8_FORMATS; anything else reads as the first one).
VM_FP8_FN_ VmFp8Format vm_fp8_format(int kv_format) {
  VmFp8Format f = {0, 0, 0.0f, false};
#define VM_FP8_PICK_(NAME, ID, M, BIAS, MAX, FN, ...) \
  if (kv_format == ID || f.mantissa_bits == 0) f = VmFp8Format{M, BIAS, float(MAX), FN != 0};
  VM_FP8_FORMATS(VM_FP8_PICK_, )
#undef VM_FP8_PICK_
  return f;
}

// The value of byte `code` of format `kv_format`.
VM_FP8_FN_ float vm_fp8_to_float(vm_u32 code, int kv_format) {
  const VmFp8Format f = vm_fp8_format(kv_format);
  const int m_bits = f.mantissa_bits;
  const vm_u32 e_max = (1u << (7 - m_bits)) - 1u;
  const vm_u32 e = (code >> m_bits) & e_max;
  const vm_u32 m = code & ((1u << m_bits) - 1u);
  float mag = 0.0f;
  if (e == e_max && (!f.finite_only || m == (1u << m_bits) - 1u)) {
    mag = VM_BITS_FLOAT_(f.finite_only || m != 0 ? 0x7FC00000u : 0x7F800000u);  // NaN / Inf
  } else if (e == 0) {  // subnormal: m * 2^(1 - bias - m_bits)
    mag = float(m) * VM_BITS_FLOAT_(vm_u32(127 + 1 - f.bias - m_bits) << 23);
  } else {
    mag = VM_BITS_FLOAT_(((e + vm_u32(127 - f.bias)) << 23) | (m << (23 - m_bits)));
  }
  return (code & 0x80u) != 0 ? -mag : mag;
}

// The byte of format `kv_format` that stores `a` (already divided by the scale).
VM_FP8_FN_ vm_u32 vm_fp8_from_float(float a, int kv_format) {
  const VmFp8Format f = vm_fp8_format(kv_format);
  const vm_u32 bits = VM_FLOAT_BITS_(a);
  vm_u32 mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return VM_FP8_NAN_CODE;
  const vm_u32 sign = (bits >> 31) != 0 && mag != 0 ? 0x80u : 0u;
  const vm_u32 max_bits = VM_FLOAT_BITS_(f.max_finite);
  if (mag > max_bits) mag = max_bits;  // saturate (infinities too)
  const int m_bits = f.mantissa_bits;
  const int min_exp = 1 - f.bias;  // exponent of the smallest normal (subnormals share its step)
  int exp = int(mag >> 23) - 127;
  vm_u32 sig = mag & 0x7FFFFFu;
  if ((mag >> 23) != 0) {
    sig |= 0x800000u;
  } else {
    exp = -126;  // a float32 subnormal
  }
  const int e = exp > min_exp ? exp : min_exp;
  const int drop = 23 - m_bits + (e - exp);  // significand bits below the byte's last one (> 0)
  vm_u32 steps = 0;
  if (drop <= 24) {
    steps = sig >> drop;
    const vm_u32 rem = sig & ((1u << drop) - 1u);
    const vm_u32 half = 1u << (drop - 1);
    if (rem > half || (rem == half && (steps & 1u) != 0)) ++steps;  // nearest, ties to even
  }
  const vm_u32 one = 1u << m_bits;
  int e_out = e;
  if (steps == 2u * one) {  // rounded up to the next power of two
    e_out += 1;
    steps = one;
  }
  const vm_u32 code = steps >= one ? (vm_u32(e_out + f.bias) << m_bits) | (steps - one) : steps;
  return code | sign;
}

#if !defined(__METAL_VERSION__)
#include <stdexcept>
#include <string>

namespace vllm_metal::cpu {

// How the pools store K/V: in the rows' (query's) element type, as fp8 bytes of a format of
// VM_FP8_FORMATS, or as per-token-head rows of VM_PTH_FORMATS (common/per_token_head.h); the
// values are the kernels' kv_format ids.
enum class KvFormat : int32_t {
  same = VM_KV_FORMAT_SAME,
#define VM_FP8_ENUM_(NAME, ID, ...) NAME = ID,
  VM_FP8_FORMATS(VM_FP8_ENUM_, ) VM_PTH_FORMATS(VM_FP8_ENUM_, )
#undef VM_FP8_ENUM_
};

// Whether the pools hold per-token-head rows (a float32 scale after each row's bytes).
static constexpr bool per_token_head(KvFormat f) {
  return f == KvFormat::int8_per_token_head || f == KvFormat::fp8_per_token_head ||
         f == KvFormat::int4_per_token_head;
}

// The KvFormat of a kv_cache_dtype the native ops take ("auto" or a format name); `op` names the
// caller in the error.
inline KvFormat kv_format_of(const std::string& kv_cache_dtype, const char* op) {
  if (kv_cache_dtype == "auto") return KvFormat::same;
#define VM_FP8_NAME_(NAME, ID, ...) \
  if (kv_cache_dtype == #NAME) return KvFormat::NAME;
  VM_FP8_FORMATS(VM_FP8_NAME_, ) VM_PTH_FORMATS(VM_FP8_NAME_, )
#undef VM_FP8_NAME_
  throw std::invalid_argument(std::string(op) + ": kv_cache_dtype must be auto, fp8_e4m3, " +
                              "fp8_e5m2, int8_per_token_head, fp8_per_token_head or " +
                              "int4_per_token_head, got " + kv_cache_dtype);
}

}  // namespace vllm_metal::cpu
#endif
