// simdgroup_matrix<T, 8, 8> for the MSL stand-in: each lane owns two elements, as on Apple GPUs.
// Loads/stores touch only the lane's own elements; multiply-accumulate gathers the simdgroup.
#pragma once

namespace metal {

// Lane -> (row, col) of its first element; the second is (row, col + 1). This is the register
// layout Apple GPUs use for 8x8 simdgroup matrices (the one code reading thread_elements() relies on).
MSL_INLINE void simdgroup_matrix_coord(unsigned lane, unsigned& row, unsigned& col) {
  const unsigned qid = lane / 4;
  row = (qid & 4u) + ((lane / 2) % 4);
  col = (qid & 2u) * 2 + (lane % 2) * 2;
}

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "only 8x8 simdgroup matrices exist");
  vec<T, 2> e;

  simdgroup_matrix() = default;
  // Diagonal matrix with `d` on the diagonal (MSL semantics of the scalar constructor).
  MSL_INLINE explicit simdgroup_matrix(T d) {
    unsigned r, c;
    simdgroup_matrix_coord(msl::lane_id(), r, c);
    e[0] = (r == c) ? d : T(0);
    e[1] = (r == c + 1) ? d : T(0);
  }
  MSL_INLINE vec<T, 2>& thread_elements() { return e; }
  MSL_INLINE const vec<T, 2>& thread_elements() const { return e; }
};

template <class T, int C, int R>
MSL_INLINE simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  m.e = vec<T, 2>(v, v);
  return m;
}

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

// Element (r, c) of the 8x8 block sits at src[(origin.y + r) * elements_per_row + origin.x + c];
// a transposed load reads the block's transpose: element (r, c) comes from (row c, col r).
template <class T, class U>
MSL_INLINE void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src,
                               size_t elements_per_row = 8, ulong2 origin = ulong2(0, 0),
                               bool transpose = false) {
  unsigned r, c;
  simdgroup_matrix_coord(msl::lane_id(), r, c);
  for (unsigned k = 0; k < 2; ++k) {
    const size_t rr = transpose ? (c + k) : r;
    const size_t cc = transpose ? r : (c + k);
    d.e[k] = static_cast<T>(src[(origin.y + rr) * elements_per_row + origin.x + cc]);
  }
}

template <class T, class U>
MSL_INLINE void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, U* dst,
                                size_t elements_per_row = 8, ulong2 origin = ulong2(0, 0),
                                bool transpose = false) {
  unsigned r, c;
  simdgroup_matrix_coord(msl::lane_id(), r, c);
  for (unsigned k = 0; k < 2; ++k) {
    const size_t rr = transpose ? (c + k) : r;
    const size_t cc = transpose ? r : (c + k);
    dst[(origin.y + rr) * elements_per_row + origin.x + cc] = static_cast<U>(a.e[k]);
  }
}

namespace detail {
struct MmaLane {
  float a[2], b[2], c[2];
};
}  // namespace detail

// d = a * b + c, accumulated in float, rounded to d's element type.
template <class TD, class TA, class TB, class TC>
MSL_INLINE void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                              const simdgroup_matrix<TA, 8, 8>& a,
                                              const simdgroup_matrix<TB, 8, 8>& b,
                                              const simdgroup_matrix<TC, 8, 8>& c, MSL_HERE) {
  detail::MmaLane mine{{float(a.e[0]), float(a.e[1])},
                       {float(b.e[0]), float(b.e[1])},
                       {float(c.e[0]), float(c.e[1])}};
  auto g = detail::gather("simdgroup_multiply_accumulate", mine, l);
  if (g.ex.active_mask != 0xffffffffu)
    msl::rt::fail("simdgroup_multiply_accumulate", "needs all 32 lanes of the simdgroup active");
  float A[8][8], B[8][8], C[8][8];
  for (unsigned ln = 0; ln < 32; ++ln) {
    unsigned r, cc;
    simdgroup_matrix_coord(ln, r, cc);
    const detail::MmaLane v = g.at(ln);
    for (unsigned k = 0; k < 2; ++k) {
      A[r][cc + k] = v.a[k];
      B[r][cc + k] = v.b[k];
      C[r][cc + k] = v.c[k];
    }
  }
  unsigned r, cc;
  simdgroup_matrix_coord(g.ex.lane, r, cc);
  for (unsigned k = 0; k < 2; ++k) {
    float s = C[r][cc + k];
    for (unsigned j = 0; j < 8; ++j) s += A[r][j] * B[j][cc + k];
    d.e[k] = static_cast<TD>(s);
  }
}

template <class TD, class TA, class TB>
MSL_INLINE void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, MSL_HERE) {
  simdgroup_matrix<TD, 8, 8> z = make_filled_simdgroup_matrix<TD, 8, 8>(TD(0));
  simdgroup_multiply_accumulate(d, a, b, z, l);
}

}  // namespace metal
