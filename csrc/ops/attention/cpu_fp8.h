// Quantized K/V elements for the CPU inner kernel (cpu_kernel.cpp): the value of every E4M3 / E5M2
// byte (common/fp8.h) and of every per-token-head element byte (common/per_token_head.h), vector
// loads through those tables, and the traits the kernel reads K/V with (the query's element type,
// fp8 bytes, or per-token-head rows with their own scales).
//
// Included only by cpu_kernel.cpp, which is compiled once per ISA: everything here sits in an
// anonymous namespace, as in cpu_simd.h.
#pragma once

#include <cstdint>

#include "common/fp8.h"
#include "common/per_token_head.h"
#include "ops/attention/cpu.h"
#include "ops/attention/cpu_simd.h"

namespace vllm_metal::cpu {
namespace {

// The value of every fp8 byte of a format (common/fp8.h, the formats of constants.h), built at
// compile time.
struct Fp8Table {
  float v[256];
};
constexpr Fp8Table fp8_table(KvFormat format) {
  Fp8Table t{};
  for (int code = 0; code < 256; ++code) {
    t.v[code] = vm_fp8_to_float(static_cast<vm_u32>(code), static_cast<int>(format));
  }
  return t;
}
constexpr Fp8Table kFp8E4M3 = fp8_table(KvFormat::fp8_e4m3);
constexpr Fp8Table kFp8E5M2 = fp8_table(KvFormat::fp8_e5m2);

// The unscaled value of every element byte of a per-token-head format.
constexpr Fp8Table pth_table(KvFormat format) {
  Fp8Table t{};
  for (int code = 0; code < 256; ++code) {
    t.v[code] = vm_pth_element(static_cast<vm_u32>(code), static_cast<int>(format));
  }
  return t;
}
constexpr Fp8Table kPthInt8 = pth_table(KvFormat::int8_per_token_head);
constexpr Fp8Table kPthFp8 = pth_table(KvFormat::fp8_per_token_head);

// VW fp8 bytes widened through their format's table (one gather where the ISA has one).
inline vf fp8_vec(const uint8_t* p, const float* table) {
#if defined(__AVX512F__)
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm512_i32gather_ps(idx, table, 4);
#elif defined(__AVX2__)
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm256_i32gather_ps(table, idx, 4);
#else
  vf r;
  for (int u = 0; u < VW; ++u) r[u] = table[p[u]];
  return r;
#endif
}

// The VW int4 levels of VW / 2 packed bytes, in element order (vm_pth_int4_level: element 2i the
// low nibble of byte i): the nibbles split and interleaved, then widened, where the ISA has it.
inline vf int4_vec(const uint8_t* p) {
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
#else
  int32_t four;
  __builtin_memcpy(&four, p, 4);
  const __m128i b = _mm_cvtsi32_si128(four);
#endif
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m128i levels = _mm_unpacklo_epi8(lo, hi);  // lo0 hi0 lo1 hi1 ...
#if defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(levels));
#else
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(levels));
#endif
#else
  vf r;
  for (int u = 0; u < VW / 2; ++u) {
    r[2 * u] = float(vm_pth_int4_level(p[u], 0));
    r[2 * u + 1] = float(vm_pth_int4_level(p[u], 1));
  }
  return r;
#endif
}

// How the kernel reads K/V elements of one pool row `row` (KV head `kv_begin + hk`'s first
// element or byte): `zero(row, D)` is the row's offset subtracted from each element, `load(row, d,
// zero)` widens element d to float32, `vec(row, d, zero)` VW of them from d on. F = 0: the pools
// hold the query's element type E; otherwise bytes of that KvFormat, read unscaled: the run folds
// the scales into the queries and the probabilities (fp8's per-tensor k_scale / v_scale), or
// (per_row) multiplies each key's score and each value's probability by the row's own scale,
// `row_scale` of the row's bytes (its elements, then the scale). int4 rows read their levels
// from nibbles less the row's zero point (common/per_token_head.h).
template <ElemType E, KvFormat F>
struct KvElem {
  using T = typename Elem<E>::T;
  static constexpr bool per_row = false;
  static float zero(const T*, int64_t) { return 0.0f; }
  static float load(const T* row, int64_t d, float) { return Elem<E>::load(row[d]); }
  static vf vec(const T* row, int64_t d, float) { return load_vec<E>(row + d); }
};
template <const Fp8Table& Table, bool PerRow>
struct ByteKv {
  using T = uint8_t;
  static constexpr bool per_row = PerRow;
  static float zero(const uint8_t*, int64_t) { return 0.0f; }
  static float load(const uint8_t* row, int64_t d, float) { return Table.v[row[d]]; }
  static vf vec(const uint8_t* row, int64_t d, float) { return fp8_vec(row + d, Table.v); }
  static float row_scale(const uint8_t* row, int64_t head_dim) {
    const uint8_t* s = row + head_dim;
    return vm_pth_scale(s[0], s[1], s[2], s[3]);
  }
};
struct Int4Kv {
  using T = uint8_t;
  static constexpr bool per_row = true;
  static float stored(const uint8_t* row, int64_t head_dim) {
    const uint8_t* s = row + head_dim / 2;
    return vm_pth_scale(s[0], s[1], s[2], s[3]);
  }
  static float zero(const uint8_t* row, int64_t head_dim) {
    return vm_pth_int4_zp(stored(row, head_dim));
  }
  static float load(const uint8_t* row, int64_t d, float zero) {
    return float(vm_pth_int4_level(row[d / 2], static_cast<int>(d))) - zero;
  }
  static vf vec(const uint8_t* row, int64_t d, float zero) {  // d even
    return int4_vec(row + d / 2) - vsplat(zero);
  }
  static float row_scale(const uint8_t* row, int64_t head_dim) {
    return vm_pth_int4_scale(stored(row, head_dim));
  }
};
template <ElemType E>
struct KvElem<E, KvFormat::fp8_e4m3> : ByteKv<kFp8E4M3, false> {};
template <ElemType E>
struct KvElem<E, KvFormat::fp8_e5m2> : ByteKv<kFp8E5M2, false> {};
template <ElemType E>
struct KvElem<E, KvFormat::int8_per_token_head> : ByteKv<kPthInt8, true> {};
template <ElemType E>
struct KvElem<E, KvFormat::fp8_per_token_head> : ByteKv<kPthFp8, true> {};
template <ElemType E>
struct KvElem<E, KvFormat::int4_per_token_head> : Int4Kv {};

}  // namespace
}  // namespace vllm_metal::cpu
