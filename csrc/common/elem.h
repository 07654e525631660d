// The element types of the CPU drivers (float32, float16, bfloat16) and their scalar traits: load
// widens one element to float32, store narrows it back (convert.h), and dispatch_elem turns the
// run-time ElemType into the traits a driver's template is instantiated with.
//
// Included by the attention kernel objects that are compiled once per instruction set: everything
// but the enum has internal linkage (an anonymous namespace) and no STL template is used, so each
// build keeps its own copy (see ops/attention/cpu_kernel.cpp).
#pragma once

#include <cstdint>

#include "common/convert.h"

namespace vllm_metal::cpu {

enum class ElemType : int32_t { f32 = 0, f16 = 1, bf16 = 2 };

namespace {

template <ElemType E>
struct Elem;
template <>
struct Elem<ElemType::f32> {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Elem<ElemType::f16> {
  using T = uint16_t;
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }
};
template <>
struct Elem<ElemType::bf16> {
  using T = uint16_t;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
};

// Bytes per element.
inline int64_t elem_size(ElemType t) { return t == ElemType::f32 ? 4 : 2; }

// Calls fn(Elem<t>{}): fn is a generic lambda, and decltype of its argument names the traits.
template <typename Fn>
inline void dispatch_elem(ElemType t, const Fn& fn) {
  switch (t) {
    case ElemType::f32:
      return fn(Elem<ElemType::f32>{});
    case ElemType::f16:
      return fn(Elem<ElemType::f16>{});
    case ElemType::bf16:
      return fn(Elem<ElemType::bf16>{});
  }
}

// a · b with eight partial sums in a fixed order, so the loop vectorises without -ffast-math.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

}  // namespace

}  // namespace vllm_metal::cpu
