// Host stand-in for the subset of the Metal Shading Language used by metal_kernels/*.metal.
// Types, metal:: math, simdgroup collectives, barriers and simdgroup_matrix, backed by tests/msl/runtime.
#pragma once

// Every standard header is included before the address-space macros below are defined: names such
// as `thread` or `device` would otherwise rewrite parts of the standard library.
#include <algorithm>
#include <array>
#include <bit>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>
#include <utility>

#include "runtime_api.h"

#define MSL_INLINE inline __attribute__((always_inline))

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 400
#endif

namespace msl {

inline rt::Site site_of(const std::source_location& l) {
  return rt::Site{l.file_name(), static_cast<unsigned>(l.line()), static_cast<unsigned>(l.column())};
}

inline unsigned lane_id() {
  uint32_t p[3];
  rt::position(rt::Pos::thread_index_in_simdgroup, p);
  return p[0];
}

}  // namespace msl

// ---------------------------------------------------------------------------------------------
// Scalar types
// ---------------------------------------------------------------------------------------------

typedef _Float16 half;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

// bfloat: 1-8-7 brain float stored as the upper half of a float32. Conversion from float rounds to
// nearest even (NaN stays NaN); arithmetic is done in float and rounded back, as the GPU does.
struct bfloat {
  uint16_t bits;

  bfloat() = default;
  static constexpr uint16_t round_from(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    const uint32_t lsb = (u >> 16) & 1u;
    return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
  constexpr bfloat(float f) : bits(round_from(f)) {}
  constexpr bfloat(double d) : bits(round_from(static_cast<float>(d))) {}
  constexpr bfloat(half h) : bits(round_from(static_cast<float>(h))) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  constexpr bfloat(I i) : bits(round_from(static_cast<float>(i))) {}
  constexpr operator float() const { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }
  static constexpr bfloat from_bits(uint16_t b) {
    bfloat r{};
    r.bits = b;
    return r;
  }
};

// bfloat op bfloat -> bfloat; bfloat op float -> float; bfloat op integer -> bfloat.
#define MSL_BF_ARITH(op)                                                                  \
  MSL_INLINE bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); } \
  MSL_INLINE float operator op(bfloat a, float b) { return float(a) op b; }                \
  MSL_INLINE float operator op(float a, bfloat b) { return a op float(b); }                \
  MSL_INLINE float operator op(bfloat a, half b) { return float(a) op float(b); }          \
  MSL_INLINE float operator op(half a, bfloat b) { return float(a) op float(b); }          \
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                     \
  MSL_INLINE bfloat operator op(bfloat a, I b) { return bfloat(float(a) op float(b)); }    \
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                     \
  MSL_INLINE bfloat operator op(I a, bfloat b) { return bfloat(float(a) op float(b)); }    \
  MSL_INLINE bfloat& operator op##=(bfloat& a, bfloat b) { return a = a op b; }             \
  MSL_INLINE bfloat& operator op##=(bfloat& a, float b) { return a = bfloat(float(a) op b); }
MSL_BF_ARITH(+)
MSL_BF_ARITH(-)
MSL_BF_ARITH(*)
MSL_BF_ARITH(/)
#undef MSL_BF_ARITH
MSL_INLINE bfloat operator-(bfloat a) { return bfloat::from_bits(a.bits ^ 0x8000u); }
#define MSL_BF_CMP(op)                                                                   \
  MSL_INLINE bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }        \
  MSL_INLINE bool operator op(bfloat a, float b) { return float(a) op b; }                \
  MSL_INLINE bool operator op(float a, bfloat b) { return a op float(b); }                \
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                    \
  MSL_INLINE bool operator op(bfloat a, I b) { return float(a) op float(b); }
MSL_BF_CMP(<)
MSL_BF_CMP(>)
MSL_BF_CMP(<=)
MSL_BF_CMP(>=)
MSL_BF_CMP(==)
MSL_BF_CMP(!=)
#undef MSL_BF_CMP

namespace msl {
template <class T>
inline constexpr bool is_scalar_v = std::is_arithmetic_v<T> || std::is_same_v<T, half> ||
                                    std::is_same_v<T, bfloat>;
}

// ---------------------------------------------------------------------------------------------
// Vector types: vec<T, N> with .x/.y/.z/.w (.r/.g/.b/.a), a few swizzles, [i], elementwise ops.
// ---------------------------------------------------------------------------------------------

namespace metal {
template <class T, int N>
struct vec;
}
using metal::vec;

namespace msl {

template <class T, int S, int... I>
struct swizzle {
  T d[S];
  MSL_INLINE operator vec<T, sizeof...(I)>() const { return vec<T, sizeof...(I)>(d[I]...); }
  MSL_INLINE swizzle& operator=(const vec<T, sizeof...(I)>& o) {
    int k = 0;
    ((d[I] = o[k++]), ...);
    return *this;
  }
};

template <class T, int N>
struct vec_storage;
template <class T>
struct vec_storage<T, 2> {
  union {
    T v[2];
    struct { T x, y; };
    struct { T r, g; };
    swizzle<T, 2, 1, 0> yx;
  };
};
template <class T>
struct vec_storage<T, 3> {
  union {
    T v[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
    swizzle<T, 4, 0, 1> xy;
    swizzle<T, 4, 1, 2> yz;
  };
};
template <class T>
struct vec_storage<T, 4> {
  union {
    T v[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    swizzle<T, 4, 0, 1> xy;
    swizzle<T, 4, 2, 3> zw;
    swizzle<T, 4, 0, 1, 2> xyz;
    swizzle<T, 4, 1, 2, 3> yzw;
    swizzle<T, 4, 3, 2, 1, 0> wzyx;
  };
};

template <class A>
struct components {
  static constexpr int value = 1;
};
template <class T, int N>
struct components<metal::vec<T, N>> {
  static constexpr int value = N;
};
template <class T, int S, int... I>
struct components<swizzle<T, S, I...>> {
  static constexpr int value = sizeof...(I);
};

}  // namespace msl

namespace metal {

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : msl::vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;
  MSL_INLINE vec(const vec&) = default;
  MSL_INLINE vec& operator=(const vec&) = default;
  // Scalar widening (MSL allows `float4 x = 0.0f;`).
  template <class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>
  MSL_INLINE vec(U s) {
    for (int i = 0; i < N; ++i) this->v[i] = static_cast<T>(s);
  }
  // Component-wise construction: float4(a, b, c, d), float4(float2, float2), float4(float3, w), ...
  template <class A0, class A1, class... A,
            std::enable_if_t<(msl::components<A0>::value + msl::components<A1>::value +
                                  (0 + ... + msl::components<A>::value) ==
                              N),
                             int> = 0>
  MSL_INLINE vec(const A0& a0, const A1& a1, const A&... a) {
    int k = 0;
    put(k, a0);
    put(k, a1);
    (put(k, a), ...);
  }
  template <class U>
  MSL_INLINE explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v[i] = static_cast<T>(o.v[i]);
  }
  template <int S, int... I>
  MSL_INLINE vec(const msl::swizzle<T, S, I...>& s) : vec(static_cast<vec>(s)) {}

  MSL_INLINE T& operator[](int i) { return this->v[i]; }
  MSL_INLINE const T& operator[](int i) const { return this->v[i]; }

 private:
  template <class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>
  MSL_INLINE void put(int& k, const U& u) {
    this->v[k++] = static_cast<T>(u);
  }
  template <class U, int M>
  MSL_INLINE void put(int& k, const vec<U, M>& u) {
    for (int i = 0; i < M; ++i) this->v[k++] = static_cast<T>(u[i]);
  }
  template <class U, int S, int... I>
  MSL_INLINE void put(int& k, const msl::swizzle<U, S, I...>& u) {
    put(k, static_cast<vec<U, sizeof...(I)>>(u));
  }
};

}  // namespace metal

#define MSL_VEC_TYPES(T)     \
  typedef vec<T, 2> T##2;    \
  typedef vec<T, 3> T##3;    \
  typedef vec<T, 4> T##4;
MSL_VEC_TYPES(float)
MSL_VEC_TYPES(half)
MSL_VEC_TYPES(bfloat)
MSL_VEC_TYPES(int)
MSL_VEC_TYPES(uint)
MSL_VEC_TYPES(short)
MSL_VEC_TYPES(ushort)
MSL_VEC_TYPES(char)
MSL_VEC_TYPES(uchar)
MSL_VEC_TYPES(bool)
MSL_VEC_TYPES(long)
MSL_VEC_TYPES(ulong)
#undef MSL_VEC_TYPES

// Packed vectors: same components, element alignment.
namespace msl {
template <class T, int N>
struct packed_vec {
  T v[N];
  packed_vec() = default;
  MSL_INLINE packed_vec(const vec<T, N>& o) {
    for (int i = 0; i < N; ++i) v[i] = o[i];
  }
  MSL_INLINE operator vec<T, N>() const {
    vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = v[i];
    return r;
  }
  MSL_INLINE T& operator[](int i) { return v[i]; }
  MSL_INLINE const T& operator[](int i) const { return v[i]; }
};
}  // namespace msl
typedef msl::packed_vec<float, 2> packed_float2;
typedef msl::packed_vec<float, 3> packed_float3;
typedef msl::packed_vec<float, 4> packed_float4;
typedef msl::packed_vec<half, 2> packed_half2;
typedef msl::packed_vec<half, 3> packed_half3;
typedef msl::packed_vec<half, 4> packed_half4;
typedef msl::packed_vec<bfloat, 2> packed_bfloat2;
typedef msl::packed_vec<bfloat, 4> packed_bfloat4;

// Elementwise operators.
#define MSL_VEC_BINOP(op)                                                                     \
  template <class T, int N>                                                                   \
  MSL_INLINE vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op b[i]);                          \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N, class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>          \
  MSL_INLINE vec<T, N> operator op(const vec<T, N>& a, U b) {                                 \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(a[i] op static_cast<T>(b));             \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N, class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>          \
  MSL_INLINE vec<T, N> operator op(U a, const vec<T, N>& b) {                                 \
    vec<T, N> r;                                                                              \
    for (int i = 0; i < N; ++i) r[i] = static_cast<T>(static_cast<T>(a) op b[i]);             \
    return r;                                                                                 \
  }                                                                                           \
  template <class T, int N>                                                                   \
  MSL_INLINE vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {                    \
    return a = a op b;                                                                        \
  }                                                                                           \
  template <class T, int N, class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>          \
  MSL_INLINE vec<T, N>& operator op##=(vec<T, N>& a, U b) {                                   \
    return a = a op b;                                                                        \
  }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
MSL_VEC_BINOP(%)
MSL_VEC_BINOP(&)
MSL_VEC_BINOP(|)
MSL_VEC_BINOP(^)
MSL_VEC_BINOP(<<)
MSL_VEC_BINOP(>>)
#undef MSL_VEC_BINOP

template <class T, int N>
MSL_INLINE vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = -a[i];
  return r;
}
template <class T, int N>
MSL_INLINE vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

#define MSL_VEC_CMP(op)                                                                \
  template <class T, int N>                                                            \
  MSL_INLINE vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {        \
    vec<bool, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                   \
    return r;                                                                          \
  }                                                                                    \
  template <class T, int N, class U, std::enable_if_t<msl::is_scalar_v<U>, int> = 0>   \
  MSL_INLINE vec<bool, N> operator op(const vec<T, N>& a, U b) {                       \
    vec<bool, N> r;                                                                    \
    for (int i = 0; i < N; ++i) r[i] = a[i] op static_cast<T>(b);                      \
    return r;                                                                          \
  }
MSL_VEC_CMP(<)
MSL_VEC_CMP(>)
MSL_VEC_CMP(<=)
MSL_VEC_CMP(>=)
MSL_VEC_CMP(==)
MSL_VEC_CMP(!=)
MSL_VEC_CMP(&&)
MSL_VEC_CMP(||)
#undef MSL_VEC_CMP

// ---------------------------------------------------------------------------------------------
// metal:: library
// ---------------------------------------------------------------------------------------------

namespace metal {

using ::bfloat;
using ::half;
using std::bool_constant;
using std::conditional_t;
using std::decay_t;
using std::enable_if_t;
using std::false_type;
using std::integral_constant;
using std::is_floating_point_v;
using std::is_integral_v;
using std::is_same;
using std::is_same_v;
using std::is_signed_v;
using std::is_unsigned_v;
using std::remove_const_t;
using std::remove_cv_t;
using std::remove_reference_t;
using std::true_type;
template <class T>
using remove_addrspace_t = T;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static constexpr half infinity() { return std::bit_cast<half>(uint16_t(0x7c00)); }
  static constexpr half quiet_NaN() { return std::bit_cast<half>(uint16_t(0x7e00)); }
  static constexpr half max() { return std::bit_cast<half>(uint16_t(0x7bff)); }
  static constexpr half lowest() { return std::bit_cast<half>(uint16_t(0xfbff)); }
  static constexpr half min() { return std::bit_cast<half>(uint16_t(0x0400)); }
  static constexpr half epsilon() { return std::bit_cast<half>(uint16_t(0x1400)); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); }
};

template <class T, class U>
MSL_INLINE T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return std::bit_cast<T>(u);
}

namespace detail {
template <class T>
struct scalar_of {
  using type = T;
};
template <class T, int N>
struct scalar_of<vec<T, N>> {
  using type = T;
};
template <class T, class F>
MSL_INLINE T map1(const T& x, F f) {
  if constexpr (msl::is_scalar_v<T>) {
    return f(x);
  } else {
    T r;
    for (int i = 0; i < T::size; ++i) r[i] = f(x[i]);
    return r;
  }
}
template <class T, class F>
MSL_INLINE T map2(const T& a, const T& b, F f) {
  if constexpr (msl::is_scalar_v<T>) {
    return f(a, b);
  } else {
    T r;
    for (int i = 0; i < T::size; ++i) r[i] = f(a[i], b[i]);
    return r;
  }
}
template <class T, class F>
MSL_INLINE T map3(const T& a, const T& b, const T& c, F f) {
  if constexpr (msl::is_scalar_v<T>) {
    return f(a, b, c);
  } else {
    T r;
    for (int i = 0; i < T::size; ++i) r[i] = f(a[i], b[i], c[i]);
    return r;
  }
}
}  // namespace detail

// Float math: computed in float (half/bfloat inputs are widened, results rounded back).
#define MSL_UNARY(name, expr)                                                       \
  template <class T>                                                                \
  MSL_INLINE T name(const T& x_) {                                                  \
    using S = typename detail::scalar_of<T>::type;                                  \
    return detail::map1(x_, [](S s) -> S {                                          \
      const float x = static_cast<float>(s);                                        \
      return static_cast<S>(expr);                                                  \
    });                                                                             \
  }
#define MSL_MATH_SET                                         \
  MSL_UNARY(exp, std::exp(x))                                \
  MSL_UNARY(exp2, std::exp2(x))                              \
  MSL_UNARY(exp10, std::pow(10.0f, x))                       \
  MSL_UNARY(log, std::log(x))                                \
  MSL_UNARY(log2, std::log2(x))                              \
  MSL_UNARY(log10, std::log10(x))                            \
  MSL_UNARY(sqrt, std::sqrt(x))                              \
  MSL_UNARY(rsqrt, 1.0f / std::sqrt(x))                      \
  MSL_UNARY(tanh, std::tanh(x))                              \
  MSL_UNARY(sin, std::sin(x))                                \
  MSL_UNARY(cos, std::cos(x))                                \
  MSL_UNARY(tan, std::tan(x))                                \
  MSL_UNARY(sigmoid_, 1.0f / (1.0f + std::exp(-x)))          \
  MSL_UNARY(recip, 1.0f / x)

MSL_MATH_SET
MSL_UNARY(floor, std::floor(x))
MSL_UNARY(ceil, std::ceil(x))
MSL_UNARY(round, std::round(x))
MSL_UNARY(rint, std::rint(x))
MSL_UNARY(trunc, std::trunc(x))
MSL_UNARY(fract, x - std::floor(x))
MSL_UNARY(saturate, std::fmin(std::fmax(x, 0.0f), 1.0f))
MSL_UNARY(sign, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f)))

namespace fast {
MSL_MATH_SET
template <class T>
MSL_INLINE T divide(const T& a, const T& b) {
  return a / b;
}
}  // namespace fast
namespace precise {
MSL_MATH_SET
template <class T>
MSL_INLINE T divide(const T& a, const T& b) {
  return a / b;
}
}  // namespace precise
#undef MSL_MATH_SET
#undef MSL_UNARY

template <class T>
MSL_INLINE T abs(const T& x) {
  using S = typename detail::scalar_of<T>::type;
  return detail::map1(x, [](S s) -> S { return s < S(0) ? S(-s) : s; });
}
template <class T>
MSL_INLINE T fabs(const T& x) {
  return metal::abs(x);
}
template <class T>
MSL_INLINE T max(const T& a, const T& b) {
  using S = typename detail::scalar_of<T>::type;
  return detail::map2(a, b, [](S x, S y) -> S {
    if constexpr (std::is_integral_v<S>) {
      return x > y ? x : y;
    } else {
      return static_cast<S>(std::fmax(static_cast<float>(x), static_cast<float>(y)));
    }
  });
}
template <class T>
MSL_INLINE T min(const T& a, const T& b) {
  using S = typename detail::scalar_of<T>::type;
  return detail::map2(a, b, [](S x, S y) -> S {
    if constexpr (std::is_integral_v<S>) {
      return x < y ? x : y;
    } else {
      return static_cast<S>(std::fmin(static_cast<float>(x), static_cast<float>(y)));
    }
  });
}
template <class T>
MSL_INLINE T fmax(const T& a, const T& b) {
  return metal::max(a, b);
}
template <class T>
MSL_INLINE T fmin(const T& a, const T& b) {
  return metal::min(a, b);
}
template <class T>
MSL_INLINE T clamp(const T& x, const T& lo, const T& hi) {
  return metal::min(metal::max(x, lo), hi);
}
template <class T>
MSL_INLINE T fma(const T& a, const T& b, const T& c) {
  using S = typename detail::scalar_of<T>::type;
  return detail::map3(a, b, c, [](S x, S y, S z) -> S {
    return static_cast<S>(std::fma(static_cast<float>(x), static_cast<float>(y), static_cast<float>(z)));
  });
}
template <class T>
MSL_INLINE T pow(const T& a, const T& b) {
  using S = typename detail::scalar_of<T>::type;
  return detail::map2(a, b, [](S x, S y) -> S {
    return static_cast<S>(std::pow(static_cast<float>(x), static_cast<float>(y)));
  });
}
template <class T>
MSL_INLINE T powr(const T& a, const T& b) {
  return metal::pow(a, b);
}
template <class T, class U>
MSL_INLINE T mix(const T& a, const T& b, const U& t) {
  return a + (b - a) * t;
}
template <class T>
MSL_INLINE T select(const T& a, const T& b, bool c) {
  return c ? b : a;
}
template <class T, int N>
MSL_INLINE vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T>
MSL_INLINE bool isnan(const T& x) {
  return std::isnan(static_cast<float>(x));
}
template <class T>
MSL_INLINE bool isinf(const T& x) {
  return std::isinf(static_cast<float>(x));
}
template <class T>
MSL_INLINE bool isfinite(const T& x) {
  return std::isfinite(static_cast<float>(x));
}
template <class T>
MSL_INLINE bool signbit(const T& x) {
  return std::signbit(static_cast<float>(x));
}
template <class T, int N>
MSL_INLINE T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = s + a[i] * b[i];
  return s;
}
template <int N>
MSL_INLINE bool all(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (!b[i]) return false;
  return true;
}
template <int N>
MSL_INLINE bool any(const vec<bool, N>& b) {
  for (int i = 0; i < N; ++i)
    if (b[i]) return true;
  return false;
}
MSL_INLINE bool all(bool b) { return b; }
MSL_INLINE bool any(bool b) { return b; }

template <class T>
MSL_INLINE T popcount(T x) {
  return static_cast<T>(std::popcount(static_cast<std::make_unsigned_t<T>>(x)));
}
template <class T>
MSL_INLINE T ctz(T x) {
  return x == 0 ? T(sizeof(T) * 8) : static_cast<T>(std::countr_zero(static_cast<std::make_unsigned_t<T>>(x)));
}
template <class T>
MSL_INLINE T clz(T x) {
  return static_cast<T>(std::countl_zero(static_cast<std::make_unsigned_t<T>>(x)));
}
template <class T>
MSL_INLINE T mulhi(T a, T b) {
  return static_cast<T>((static_cast<int64_t>(a) * static_cast<int64_t>(b)) >> (sizeof(T) * 8));
}

// ---------------------------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------------------------

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
MSL_INLINE constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

MSL_INLINE void threadgroup_barrier(mem_flags f,
                                    std::source_location l = std::source_location::current()) {
  msl::rt::threadgroup_barrier(static_cast<unsigned>(f), msl::site_of(l));
}
MSL_INLINE void simdgroup_barrier(mem_flags f,
                                  std::source_location l = std::source_location::current()) {
  msl::rt::simdgroup_barrier(static_cast<unsigned>(f), msl::site_of(l));
}

// ---------------------------------------------------------------------------------------------
// SIMD-group functions (32 lanes). Every live lane of the simdgroup must reach the same call;
// lanes that returned from the kernel are inactive, as on the GPU.
// ---------------------------------------------------------------------------------------------

namespace detail {

template <class T>
struct Gathered {
  msl::rt::Exchange ex;
  MSL_INLINE bool active(unsigned l) const { return (ex.active_mask >> l) & 1u; }
  MSL_INLINE T at(unsigned l) const {
    T v;
    std::memcpy(static_cast<void*>(&v), ex.values + l * ex.stride, sizeof(T));
    return v;
  }
  MSL_INLINE T from(unsigned l, const char* op) const {
    if (l >= 32 || !active(l)) msl::rt::fail(op, "reads a lane that is inactive or out of range");
    return at(l);
  }
};

template <class T>
MSL_INLINE Gathered<T> gather(const char* op, const T& x, const std::source_location& l) {
  return Gathered<T>{msl::rt::simd_exchange(op, &x, sizeof(T), msl::site_of(l))};
}

// Tree reduction over active lanes, in lane order, in the value type.
template <class T, class F>
MSL_INLINE T reduce(const Gathered<T>& g, F f, unsigned lo = 0, unsigned n = 32) {
  T vals[32];
  unsigned k = 0;
  for (unsigned i = lo; i < lo + n; ++i)
    if (g.active(i)) vals[k++] = g.at(i);
  while (k > 1) {
    unsigned h = 0;
    for (unsigned i = 0; i + 1 < k; i += 2) vals[h++] = f(vals[i], vals[i + 1]);
    if (k & 1u) vals[h++] = vals[k - 1];
    k = h;
  }
  return vals[0];
}

}  // namespace detail

#define MSL_HERE std::source_location l = std::source_location::current()

template <class T>
MSL_INLINE T simd_sum(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_sum", x, l), [](T a, T b) -> T { return a + b; });
}
template <class T>
MSL_INLINE T simd_product(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_product", x, l), [](T a, T b) -> T { return a * b; });
}
template <class T>
MSL_INLINE T simd_max(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_max", x, l), [](T a, T b) -> T { return metal::max(a, b); });
}
template <class T>
MSL_INLINE T simd_min(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_min", x, l), [](T a, T b) -> T { return metal::min(a, b); });
}
template <class T>
MSL_INLINE T simd_and(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_and", x, l), [](T a, T b) -> T { return a & b; });
}
template <class T>
MSL_INLINE T simd_or(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_or", x, l), [](T a, T b) -> T { return a | b; });
}
template <class T>
MSL_INLINE T simd_xor(T x, MSL_HERE) {
  return detail::reduce(detail::gather("simd_xor", x, l), [](T a, T b) -> T { return a ^ b; });
}
template <class T>
MSL_INLINE T simd_prefix_exclusive_sum(T x, MSL_HERE) {
  auto g = detail::gather("simd_prefix_exclusive_sum", x, l);
  T s = T(0);
  for (unsigned i = 0; i < g.ex.lane; ++i)
    if (g.active(i)) s = s + g.at(i);
  return s;
}
template <class T>
MSL_INLINE T simd_prefix_inclusive_sum(T x, MSL_HERE) {
  auto g = detail::gather("simd_prefix_inclusive_sum", x, l);
  T s = T(0);
  for (unsigned i = 0; i <= g.ex.lane; ++i)
    if (g.active(i)) s = s + g.at(i);
  return s;
}
template <class T, class I>
MSL_INLINE T simd_shuffle(T x, I lane, MSL_HERE) {
  auto g = detail::gather("simd_shuffle", x, l);
  return g.from(static_cast<unsigned>(lane), "simd_shuffle");
}
template <class T, class I>
MSL_INLINE T simd_broadcast(T x, I lane, MSL_HERE) {
  auto g = detail::gather("simd_broadcast", x, l);
  return g.from(static_cast<unsigned>(lane), "simd_broadcast");
}
template <class T>
MSL_INLINE T simd_broadcast_first(T x, MSL_HERE) {
  auto g = detail::gather("simd_broadcast_first", x, l);
  return g.at(static_cast<unsigned>(std::countr_zero(g.ex.active_mask)));
}
template <class T, class I>
MSL_INLINE T simd_shuffle_xor(T x, I mask, MSL_HERE) {
  auto g = detail::gather("simd_shuffle_xor", x, l);
  return g.from(g.ex.lane ^ static_cast<unsigned>(mask), "simd_shuffle_xor");
}
// shuffle_down/up: lanes whose source falls outside the simdgroup keep their own value.
template <class T, class I>
MSL_INLINE T simd_shuffle_down(T x, I delta, MSL_HERE) {
  auto g = detail::gather("simd_shuffle_down", x, l);
  const unsigned src = g.ex.lane + static_cast<unsigned>(delta);
  return src < 32 ? g.from(src, "simd_shuffle_down") : x;
}
template <class T, class I>
MSL_INLINE T simd_shuffle_up(T x, I delta, MSL_HERE) {
  auto g = detail::gather("simd_shuffle_up", x, l);
  const int src = static_cast<int>(g.ex.lane) - static_cast<int>(delta);
  return src >= 0 ? g.from(static_cast<unsigned>(src), "simd_shuffle_up") : x;
}
template <class T, class I>
MSL_INLINE T simd_shuffle_rotate_down(T x, I delta, MSL_HERE) {
  auto g = detail::gather("simd_shuffle_rotate_down", x, l);
  return g.from((g.ex.lane + static_cast<unsigned>(delta)) % 32u, "simd_shuffle_rotate_down");
}
template <class T, class I>
MSL_INLINE T simd_shuffle_rotate_up(T x, I delta, MSL_HERE) {
  auto g = detail::gather("simd_shuffle_rotate_up", x, l);
  return g.from((g.ex.lane + 32u - static_cast<unsigned>(delta) % 32u) % 32u, "simd_shuffle_rotate_up");
}
MSL_INLINE bool simd_all(bool b, MSL_HERE) {
  auto g = detail::gather("simd_all", b, l);
  for (unsigned i = 0; i < 32; ++i)
    if (g.active(i) && !g.at(i)) return false;
  return true;
}
MSL_INLINE bool simd_any(bool b, MSL_HERE) {
  auto g = detail::gather("simd_any", b, l);
  for (unsigned i = 0; i < 32; ++i)
    if (g.active(i) && g.at(i)) return true;
  return false;
}
struct simd_vote {
  using vote_t = uint64_t;
  vote_t v;
  MSL_INLINE explicit operator vote_t() const { return v; }
  MSL_INLINE bool all() const { return v == 0xffffffffull; }
  MSL_INLINE bool any() const { return v != 0; }
};
MSL_INLINE simd_vote simd_ballot(bool b, MSL_HERE) {
  auto g = detail::gather("simd_ballot", b, l);
  uint64_t m = 0;
  for (unsigned i = 0; i < 32; ++i)
    if (g.active(i) && g.at(i)) m |= (1ull << i);
  return simd_vote{m};
}
MSL_INLINE simd_vote simd_active_threads_mask(MSL_HERE) {
  auto g = detail::gather("simd_active_threads_mask", true, l);
  return simd_vote{g.ex.active_mask};
}
MSL_INLINE bool simd_is_first(MSL_HERE) {
  auto g = detail::gather("simd_is_first", true, l);
  return g.ex.lane == static_cast<unsigned>(std::countr_zero(g.ex.active_mask));
}

// Quad-group (4 lanes) variants.
template <class T>
MSL_INLINE T quad_sum(T x, MSL_HERE) {
  auto g = detail::gather("quad_sum", x, l);
  return detail::reduce(g, [](T a, T b) -> T { return a + b; }, g.ex.lane & ~3u, 4);
}
template <class T>
MSL_INLINE T quad_max(T x, MSL_HERE) {
  auto g = detail::gather("quad_max", x, l);
  return detail::reduce(g, [](T a, T b) -> T { return metal::max(a, b); }, g.ex.lane & ~3u, 4);
}
template <class T, class I>
MSL_INLINE T quad_shuffle_xor(T x, I mask, MSL_HERE) {
  auto g = detail::gather("quad_shuffle_xor", x, l);
  return g.from((g.ex.lane & ~3u) | ((g.ex.lane ^ static_cast<unsigned>(mask)) & 3u), "quad_shuffle_xor");
}
template <class T, class I>
MSL_INLINE T quad_broadcast(T x, I lane, MSL_HERE) {
  auto g = detail::gather("quad_broadcast", x, l);
  return g.from((g.ex.lane & ~3u) | (static_cast<unsigned>(lane) & 3u), "quad_broadcast");
}
template <class T, class I>
MSL_INLINE T quad_shuffle(T x, I lane, MSL_HERE) {
  auto g = detail::gather("quad_shuffle", x, l);
  return g.from((g.ex.lane & ~3u) | (static_cast<unsigned>(lane) & 3u), "quad_shuffle");
}

}  // namespace metal

#include "simdgroup_matrix.h"

// Glue used by the source mapping and the generated shim (tests/msl/harness.py).
namespace msl {
// "... [with auto Fn = kernel<half, 64, 8>]": how the runner names an instantiated kernel.
template <auto Fn>
const char* function_name() {
  return __PRETTY_FUNCTION__;
}
// "... [with Where = kernel<half, 64, 8>(params)::<lambda()>]" for a lambda declared in the kernel.
template <class Where>
const char* where_name() {
  return __PRETTY_FUNCTION__;
}
// Instantiated (hence initialised at program start) once per threadgroup declaration of each
// instantiated function: the declaring lambda's closure type differs per instantiation.
template <class T, class Where>
struct TgStatic {
  static inline const bool declared =
      (rt::declare_threadgroup_variable(where_name<Where>(), Where{}(), sizeof(T), alignof(T)),
       true);
};
// `threadgroup T name[N];` (see the source mapping in tests/msl/translate.py).
template <class T, class Where>
MSL_INLINE T& tg_var(unsigned key, Where where) {
  static_cast<void>(&TgStatic<T, Where>::declared);
  return *static_cast<T*>(rt::threadgroup_variable(key, sizeof(T), alignof(T), where().name));
}
struct BufferPtr {
  void* p;
  template <class U>
  MSL_INLINE operator U*() const { return static_cast<U*>(p); }
};
struct BufferRef {
  void* p;
  template <class U>
  MSL_INLINE operator U&() const { return *static_cast<U*>(p); }
};
struct PositionArg {
  uint32_t v[3];
  template <class U>
  MSL_INLINE operator U() const {
    if constexpr (is_scalar_v<U>) {
      return static_cast<U>(v[0]);
    } else if constexpr (U::size == 2) {
      return U(v[0], v[1]);
    } else {
      return U(v[0], v[1], v[2]);
    }
  }
};
MSL_INLINE PositionArg position_arg(rt::Pos p) {
  PositionArg a;
  rt::position(p, a.v);
  return a;
}
// `constant T name [[function_constant(N)]];` becomes `static msl::FunctionConstant<T, N> name;`.
template <class T, int Index>
struct FunctionConstant {
  MSL_INLINE operator T() const {
    T v{};
    if (!rt::function_constant(Index, &v, sizeof(T)))
      rt::fail("function-constant", "kernel reads a function constant that was not set");
    return v;
  }
  MSL_INLINE bool defined() const {
    T v{};
    return rt::function_constant(Index, &v, sizeof(T));
  }
};
}  // namespace msl
namespace metal {
template <class T, int I>
MSL_INLINE bool is_function_constant_defined(const msl::FunctionConstant<T, I>& c) {
  return c.defined();
}
}  // namespace metal

// Vector and scalar types are also reachable as metal::float4 etc.
namespace metal {
using ::bfloat2;
using ::bfloat4;
using ::float2;
using ::float3;
using ::float4;
using ::half2;
using ::half3;
using ::half4;
using ::int2;
using ::int4;
using ::uint;
using ::uint2;
using ::uint3;
using ::uint4;
using ::ushort;
using ::ushort2;
using ::uchar;
}  // namespace metal

#define MAXFLOAT FLT_MAX
#define MAXHALF ((half)65504.0f)
#define HALF_MAX ((half)65504.0f)
#define FLT_MAX_EXP__ FLT_MAX_EXP
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_SQRT2_F 1.41421356237309504880f
#define M_LOG2E_H ((half)1.44269504088896340736f)
#define M_LN2_H ((half)0.693147180559945309417f)

// Address spaces and the kernel keyword. `threadgroup` variable declarations are rewritten by the
// harness's source mapping (tests/msl/harness.py) before compilation; what is left are pointer and
// reference qualifiers, which carry no meaning on the host.
#define device
#define constant const
#define thread
#define threadgroup
#define kernel

#include "tensor_ops.h"
