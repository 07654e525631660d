// Scalar float32 <-> float16 / bfloat16 conversions used by the CPU bodies.
//
// Exact widening, round-to-nearest-even narrowing, branch-free widening so row loops vectorise.
// Everything here has internal linkage (static), so objects built with different instruction-set
// flags each keep their own copy.
#pragma once

#include <cstdint>

namespace vllm_metal::cpu {

static inline float from_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

static inline uint32_t to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
}

static inline float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

// Branch-free so that a loop over a row vectorises; handles subnormals, infinities and NaN.
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const uint32_t special = 0x7f800000u | (mant << 13);
  const float subnormal = static_cast<float>(static_cast<int32_t>(mant)) * 5.9604644775390625e-8f;
  uint32_t bits = exp == 0x1fu ? special : normal;
  bits = exp == 0 ? to_bits(subnormal) : bits;
  return from_bits(bits | sign);
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t x = to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

static inline uint16_t float_to_half(float f) {
  uint32_t x = to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (x >= 0x47800000u) return sign | 0x7c00u;  // overflow (and inf) -> inf
  if (x < 0x38800000u) {
    // Below the smallest normal half: round |f| * 2^24 to an integer count of 2^-24.
    const float v = from_bits(x) * 16777216.0f;
    return sign | static_cast<uint16_t>(__builtin_nearbyintf(v));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | static_cast<uint16_t>((x - 0x38000000u) >> 13);
}

}  // namespace vllm_metal::cpu
