// Vector types and math at the width of the instruction set the including object is built for
// (AVX-512: 16 floats, AVX2: 8, otherwise 4), with GCC/Clang vector extensions.
//
// Included only by cpu_kernel.cpp, which is compiled once per ISA: everything here sits in an
// anonymous namespace, so each build keeps its own copy (see cpu_kernel.cpp). The scalar element
// traits Elem<E> come from common/elem.h, built the same way.
#pragma once

#include <cstdint>

#include "common/convert.h"
#include "ops/attention/cpu.h"

#if defined(__x86_64__) && (defined(__AVX__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

namespace vllm_metal::cpu {
namespace {

#if defined(__AVX512F__)
constexpr int VW = 16;
#elif defined(__AVX2__)
constexpr int VW = 8;
#else
constexpr int VW = 4;
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

inline vf vload(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline vf vsplat(float x) { return vf{} + x; }
inline vf vselect(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

typedef uint16_t vh __attribute__((vector_size(VW * 2)));

inline vi vselect_i(vi mask, vi a, vi b) { return (mask & a) | (~mask & b); }

// VW consecutive elements widened to float32.
template <ElemType E>
inline vf load_vec(const typename Elem<E>::T* p) {
  if constexpr (E == ElemType::f32) {
    return vload(p);
  } else {
    vh h;
    __builtin_memcpy(&h, p, sizeof(h));
    const vi x = __builtin_convertvector(h, vi);  // zero-extends
    if constexpr (E == ElemType::bf16) {
      return (vf)(x << 16);
    } else {
#if defined(__AVX512F__)
      return (vf)_mm512_cvtph_ps((__m256i)h);
#elif defined(__F16C__) && defined(__AVX__)
      return (vf)_mm256_cvtph_ps((__m128i)h);
#else
      const vi exp = (x >> 10) & 0x1f;
      const vi mant = x & 0x3ff;
      const vi normal = ((exp + 112) << 23) | (mant << 13);
      const vi special = 0x7f800000 | (mant << 13);
      const vf subnormal = __builtin_convertvector(mant, vf) * 5.9604644775390625e-8f;
      vi bits = vselect_i(exp == 0x1f, special, normal);
      bits = vselect_i(exp == 0, (vi)subnormal, bits);
      return (vf)(bits | ((x & 0x8000) << 16));
#endif
    }
  }
}

inline float hsum(v4f v) { return (v[0] + v[2]) + (v[1] + v[3]); }
inline float hsum(v8f v) {
  v4f lo, hi;
  __builtin_memcpy(&lo, &v, sizeof(lo));
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  return hsum(lo + hi);
}
inline float hsum(v16f v) {
  v8f lo, hi;
  __builtin_memcpy(&lo, &v, sizeof(lo));
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  return hsum(lo + hi);
}

// exp(x), ~1 ulp on [-88, 88]; below -88 (and -inf) gives 0, NaN stays NaN. Cody–Waite reduction
// to r in [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes expf coefficients).
inline vf vexp(vf x) {
  x = vselect(x < vsplat(-88.0f), vsplat(-88.0f), x);
  x = vselect(x > vsplat(88.0f), vsplat(88.0f), x);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vsplat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = __builtin_convertvector(n, vi) + 127;  // 0 .. 215 after the clamp
  return p * (vf)(e << 23);
}

inline float exp1(float x) { return vexp(vsplat(x))[0]; }

// c * tanh(x / c) on a row, absolute error ~1e-7 * c.
inline void softcap_row(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  int64_t j = 0;
  for (; j + VW <= n; j += VW) {
    const vf y = vload(x + j) * inv;
    const vi neg = y < vsplat(0.0f);
    const vf a = vselect(neg, -y, y);
    const vf t = 1.0f - 2.0f / (vexp(2.0f * a) + 1.0f);
    vstore(x + j, cap * vselect(neg, -t, t));
  }
  for (; j < n; ++j) {
    const float y = x[j] * inv;
    const float a = y < 0 ? -y : y;
    const float t = 1.0f - 2.0f / (exp1(2.0f * a) + 1.0f);
    x[j] = cap * (y < 0 ? -t : t);
  }
}

}  // namespace
}  // namespace vllm_metal::cpu
