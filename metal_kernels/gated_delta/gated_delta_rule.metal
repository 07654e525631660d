// The gated delta rule over a packed varlen batch: per token, S = g S; S += beta (v - S k) k^T;
// y = S q (float32 state and math).
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers, uint3
// [[threadgroup_position_in_grid]], uint [[thread_index_in_simdgroup]], uint
// [[simdgroup_index_in_threadgroup]], simd_sum, half / bfloat / float.
//
// Grid: (ceil(Dv / VM_GATED_DELTA_ROWS), Hv, S) threadgroups of VM_GATED_DELTA_ROWS simdgroups.
// Simdgroup r of threadgroup (x, h, s) owns value row i = x * ROWS + r of head h's state for
// sequence s: lane l holds the row's elements l, l + 32, ... (up to VM_GATED_DELTA_MAX_KEY_DIM) in
// registers and steps through the sequence's tokens in order; S k and S q are simd_sum reductions
// over the key dim. Lane 0 writes y[t, h, i]; the row is written to state_out after the last
// token. A row past Dv returns as a whole simdgroup (no barriers follow). Token rows outside every
// sequence are not written.

#include <metal_stdlib>

#include "constants.h"
#include "ops/gated_delta/params.h"

using namespace metal;

template <typename T>
[[kernel]] void gated_delta_rule(
    const device T* q [[buffer(GDR_BUF_Q)]],
    const device T* k [[buffer(GDR_BUF_K)]],
    const device T* v [[buffer(GDR_BUF_V)]],
    const device float* g [[buffer(GDR_BUF_G)]],
    const device float* beta [[buffer(GDR_BUF_BETA)]],
    const device float* state [[buffer(GDR_BUF_STATE)]],
    const device int* cu_seqlens [[buffer(GDR_BUF_CU_SEQLENS)]],
    device T* out [[buffer(GDR_BUF_OUT)]],
    device float* state_out [[buffer(GDR_BUF_STATE_OUT)]],
    constant GatedDeltaParams& p [[buffer(GDR_BUF_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int PER_LANE = VM_GATED_DELTA_MAX_KEY_DIM / VM_SIMD_WIDTH;
  const int row = int(tg.x) * VM_GATED_DELTA_ROWS + int(sg);
  const int h = int(tg.y);
  const int s = int(tg.z);
  if (row >= p.value_dim || s >= p.num_seqs) {
    return;
  }
  const int dk = p.key_dim;
  const int kh = h / (p.num_v_heads / p.num_k_heads);
  const long state_row = ((long(s) * p.num_v_heads + h) * p.value_dim + row) * dk;

  float st[PER_LANE];
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = int(lane) + j * VM_SIMD_WIDTH;
    st[j] = e < dk ? state[state_row + e] : 0.0f;
  }
  const int t0 = clamp(cu_seqlens[s], 0, p.num_tokens);
  const int t1 = clamp(cu_seqlens[s + 1], t0, p.num_tokens);
  for (int t = t0; t < t1; ++t) {
    const long kq = (long(t) * p.num_k_heads + kh) * dk;
    const long th = long(t) * p.num_v_heads + h;
    const float decay = g[th];
    float kt[PER_LANE];
    float m = 0.0f;
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = int(lane) + j * VM_SIMD_WIDTH;
      kt[j] = e < dk ? float(k[kq + e]) : 0.0f;
      st[j] *= decay;  // S = g S
      m += st[j] * kt[j];
    }
    m = simd_sum(m);  // S k
    const float delta = beta[th] * (float(v[th * p.value_dim + row]) - m);
    float y = 0.0f;
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = int(lane) + j * VM_SIMD_WIDTH;
      st[j] += delta * kt[j];
      y += e < dk ? st[j] * float(q[kq + e]) : 0.0f;
    }
    y = simd_sum(y);  // S q
    if (lane == 0) {
      out[th * p.value_dim + row] = T(y);
    }
  }
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = int(lane) + j * VM_SIMD_WIDTH;
    if (e < dk) {
      state_out[state_row + e] = st[j];
    }
  }
}

// Instances: VM_GATED_DELTA_INSTANCES of constants.h.
#define GDR_INSTANTIATE(DT, T, BYTES)                                                        \
  template [[host_name(VM_KERNEL_NAME_GATED_DELTA(DT))]] [[kernel]]                          \
  decltype(gated_delta_rule<T>) gated_delta_rule<T>;

VM_GATED_DELTA_INSTANCES(GDR_INSTANTIATE)
