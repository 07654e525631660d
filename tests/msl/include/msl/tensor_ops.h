// Metal 4 tensor-op subset (metal::tensor views + MetalPerformancePrimitives matmul2d) for the MSL
// stand-in: exactly what paged_attention_nax.metal uses, with the semantics documented there.
#pragma once



namespace metal {

template <class T, size_t N>
using array = std::array<T, N>;

template <class I, size_t Rank>
struct dextents {
  static_assert(Rank == 2, "only rank-2 tensors are supported");
  I e[Rank];
  MSL_INLINE constexpr dextents(I e0, I e1) : e{e0, e1} {}
  MSL_INLINE constexpr I extent(size_t i) const { return e[i]; }
};

struct tensor_inline {};

// Rank-2 view: element (i0, i1) at data[i0 * strides[0] + i1 * strides[1]]. The kernels use
// extents (columns, rows) with strides {1, row_pitch}.
template <class T, class Extents, class Kind = tensor_inline>
struct tensor {
  using element_type = T;
  T* data;
  Extents ext;
  array<int32_t, 2> strides;
  MSL_INLINE tensor(T* d, Extents e, array<int32_t, 2> s) : data(d), ext(e), strides(s) {}
  MSL_INLINE T& at(int i0, int i1) const {
    if (i0 < 0 || i1 < 0 || i0 >= ext.e[0] || i1 >= ext.e[1])
      msl::rt::fail("tensor-out-of-bounds", "tensor element index outside its extents");
    return data[static_cast<long>(i0) * strides[0] + static_cast<long>(i1) * strides[1]];
  }
  MSL_INLINE auto extent(size_t i) const { return ext.extent(i); }
};

template <int N>
struct execution_simdgroups {
  static constexpr int simdgroups = N;
};
using execution_simdgroup = execution_simdgroups<1>;

}  // namespace metal

namespace mpp::tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right, relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_, bool tl = false, bool tr = false,
                                bool relaxed = false, mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed),
        matmul_mode(md) {}
};

namespace detail {

// Which thread holds which destination element. Deliberately scrambled (a bijection on thread
// ids, elements strided across threads) so that kernels relying on any particular layout instead
// of get_multidimensional_index() / get_mask() produce wrong results here.
MSL_INLINE int scramble_thread(int t, int threads) { return (t * 37 + 11) % threads; }

MSL_INLINE int thread_in_group(int threads) {
  uint32_t p[3];
  msl::rt::position(msl::rt::Pos::thread_index_in_threadgroup, p);
  uint32_t n[3];
  msl::rt::position(msl::rt::Pos::simdgroups_per_threadgroup, n);
  if (static_cast<int>(n[0]) * 32 != threads)
    msl::rt::fail("matmul2d", "execution_simdgroups<N> needs a threadgroup of exactly N simdgroups");
  return static_cast<int>(p[0]);
}

template <class TL, class TR>
MSL_INLINE float product(const matmul2d_descriptor& d, const TL& a, const TR& b, int row, int col) {
  float s = 0.0f;
  for (int k = 0; k < d.k; ++k) {
    const float x = float(d.transpose_left ? a.at(row, k) : a.at(k, row));
    const float y = float(d.transpose_right ? b.at(k, col) : b.at(col, k));
    s += x * y;
  }
  return s;
}

template <class TL, class TR>
MSL_INLINE void check_shapes(const matmul2d_descriptor& d, const TL& a, const TR& b) {
  const int a0 = d.transpose_left ? d.m : d.k, a1 = d.transpose_left ? d.k : d.m;
  const int b0 = d.transpose_right ? d.k : d.n, b1 = d.transpose_right ? d.n : d.k;
  if (a.ext.e[0] != a0 || a.ext.e[1] != a1)
    msl::rt::fail("matmul2d", "left tensor extents do not match the descriptor");
  if (b.ext.e[0] != b0 || b.ext.e[1] != b1)
    msl::rt::fail("matmul2d", "right tensor extents do not match the descriptor");
}

}  // namespace detail

template <class E, int M, int N, int Threads>
struct cooperative_tensor {
  static constexpr int kCapacity = (M * N + Threads - 1) / Threads;
  E v[kCapacity];
  int16_t owner;  // scrambled thread id

  MSL_INLINE static constexpr uint16_t get_capacity() { return kCapacity; }
  MSL_INLINE int linear(int i) const { return i * Threads + owner; }
  MSL_INLINE bool get_mask(int i) const { return i >= 0 && i < kCapacity && linear(i) < M * N; }
  // (column, row) of slot i.
  MSL_INLINE metal::array<int, 2> get_multidimensional_index(int i) const {
    const int l = linear(i);
    return metal::array<int, 2>{l % N, l / N};
  }
  MSL_INLINE E& operator[](int i) {
    if (!get_mask(i)) msl::rt::fail("cooperative-tensor", "slot outside the thread's mask");
    return v[i];
  }
  MSL_INLINE const E& operator[](int i) const {
    if (!get_mask(i)) msl::rt::fail("cooperative-tensor", "slot outside the thread's mask");
    return v[i];
  }
  template <class Tensor>
  MSL_INLINE void store(const Tensor& t) const {
    if (t.ext.e[0] != N || t.ext.e[1] != M)
      msl::rt::fail("cooperative-tensor", "store target extents differ from the tensor's shape");
    for (int i = 0; i < kCapacity; ++i) {
      if (!get_mask(i)) continue;
      const auto ix = get_multidimensional_index(i);
      t.at(ix[0], ix[1]) = static_cast<typename Tensor::element_type>(v[i]);
    }
  }
};

template <matmul2d_descriptor Desc, class Exec>
struct matmul2d {
  static constexpr int kThreads = Exec::simdgroups * 32;

  template <class L, class R, class E>
  MSL_INLINE cooperative_tensor<E, Desc.m, Desc.n, kThreads> get_destination_cooperative_tensor() const {
    cooperative_tensor<E, Desc.m, Desc.n, kThreads> c;
    c.owner = static_cast<int16_t>(detail::scramble_thread(detail::thread_in_group(kThreads), kThreads));
    for (int i = 0; i < c.kCapacity; ++i) c.v[i] = E(0);
    return c;
  }

  // C = A B (+ C): C a tensor view (each element written by one thread of the group).
  template <class TL, class TR, class TC, class XC>
  MSL_INLINE void run(const metal::tensor<TL, XC>& a, const metal::tensor<TR, XC>& b,
                      const metal::tensor<TC, XC>& c,
                      std::source_location l = std::source_location::current()) const {
    detail::check_shapes(Desc, a, b);
    if (c.ext.e[0] != Desc.n || c.ext.e[1] != Desc.m)
      msl::rt::fail("matmul2d", "destination tensor extents do not match the descriptor");
    metal::simdgroup_barrier(metal::mem_flags::mem_none, l);  // all lanes must reach the call
    const int me = detail::scramble_thread(detail::thread_in_group(kThreads), kThreads);
    for (int li = me; li < Desc.m * Desc.n; li += kThreads) {
      const int row = li / Desc.n, col = li % Desc.n;
      float s = detail::product(Desc, a, b, row, col);
      if (Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate) s += float(c.at(col, row));
      c.at(col, row) = static_cast<TC>(s);
    }
  }

  // C = A B (+ C): C the destination cooperative tensor (each thread computes its own slots).
  template <class TL, class TR, class XC, class E>
  MSL_INLINE void run(const metal::tensor<TL, XC>& a, const metal::tensor<TR, XC>& b,
                      cooperative_tensor<E, Desc.m, Desc.n, kThreads>& c,
                      std::source_location l = std::source_location::current()) const {
    detail::check_shapes(Desc, a, b);
    metal::simdgroup_barrier(metal::mem_flags::mem_none, l);
    for (int i = 0; i < c.kCapacity; ++i) {
      if (!c.get_mask(i)) continue;
      const auto ix = c.get_multidimensional_index(i);
      float s = detail::product(Desc, a, b, ix[1], ix[0]);
      if (Desc.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate) s += float(c.v[i]);
      c.v[i] = static_cast<E>(s);
    }
  }
};

}  // namespace mpp::tensor_ops
