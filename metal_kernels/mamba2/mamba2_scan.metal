// The Mamba-2 selective state-space recurrence over a packed varlen batch: per token and head,
// S = exp(dt A) S + dt x B^T; y = S C + D x (float32 state and math).
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers, uint3
// [[threadgroup_position_in_grid]], uint [[thread_index_in_simdgroup]], uint
// [[simdgroup_index_in_threadgroup]], simd_sum, metal::exp, half / bfloat / float.
//
// Grid: (ceil(P / VM_MAMBA2_ROWS), H, S) threadgroups of VM_MAMBA2_ROWS simdgroups. Simdgroup r
// of threadgroup (x, h, s) owns state row p = x * ROWS + r of head h for sequence s (head h reads
// B and C of group h / (H / G)): lane l holds the row's elements l, l + 32, ... (up to
// VM_MAMBA2_MAX_STATE_DIM) in registers and steps through the sequence's tokens in order; S C is
// a simd_sum over the state dim. Lane 0 writes y[t, h, p]; the row is written to state_out after
// the last token. A row past P returns as a whole simdgroup (no barriers follow). Token rows
// outside every sequence are not written.

#include <metal_stdlib>

#include "constants.h"
#include "ops/mamba2/params.h"

using namespace metal;

template <typename T>
[[kernel]] void mamba2_scan(
    const device T* x [[buffer(M2_BUF_X)]],
    const device float* dt [[buffer(M2_BUF_DT)]],
    const device float* A [[buffer(M2_BUF_A)]],
    const device T* B [[buffer(M2_BUF_B)]],
    const device T* C [[buffer(M2_BUF_C)]],
    const device float* D [[buffer(M2_BUF_D)]],
    const device float* state [[buffer(M2_BUF_STATE)]],
    const device int* cu_seqlens [[buffer(M2_BUF_CU_SEQLENS)]],
    device T* out [[buffer(M2_BUF_OUT)]],
    device float* state_out [[buffer(M2_BUF_STATE_OUT)]],
    constant Mamba2ScanParams& p [[buffer(M2_BUF_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr int PER_LANE = VM_MAMBA2_MAX_STATE_DIM / VM_SIMD_WIDTH;
  const int row = int(tg.x) * VM_MAMBA2_ROWS + int(sg);
  const int h = int(tg.y);
  const int s = int(tg.z);
  if (row >= p.head_dim || s >= p.num_seqs) {
    return;
  }
  const int n = p.state_dim;
  const int g = h / (p.num_heads / p.num_groups);
  const long state_row = ((long(s) * p.num_heads + h) * p.head_dim + row) * n;
  const float a = A[h];
  const float skip = D[h];

  float st[PER_LANE];
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = int(lane) + j * VM_SIMD_WIDTH;
    st[j] = e < n ? state[state_row + e] : 0.0f;
  }
  const int t0 = clamp(cu_seqlens[s], 0, p.num_tokens);
  const int t1 = clamp(cu_seqlens[s + 1], t0, p.num_tokens);
  for (int t = t0; t < t1; ++t) {
    const long bc = (long(t) * p.num_groups + g) * n;
    const long th = long(t) * p.num_heads + h;
    const float step = dt[th];
    const float decay = metal::exp(step * a);
    const float xp = float(x[th * p.head_dim + row]);
    const float dx = step * xp;
    float y = 0.0f;
    for (int j = 0; j < PER_LANE; ++j) {
      const int e = int(lane) + j * VM_SIMD_WIDTH;
      if (e < n) {
        st[j] = decay * st[j] + dx * float(B[bc + e]);  // S = exp(dt A) S + dt x B
        y += st[j] * float(C[bc + e]);
      }
    }
    y = simd_sum(y);  // S C
    if (lane == 0) {
      out[th * p.head_dim + row] = T(y + skip * xp);
    }
  }
  for (int j = 0; j < PER_LANE; ++j) {
    const int e = int(lane) + j * VM_SIMD_WIDTH;
    if (e < n) {
      state_out[state_row + e] = st[j];
    }
  }
}

// Instances: VM_MAMBA2_INSTANCES of constants.h.
#define M2_INSTANTIATE(DT, T, BYTES)                                                         \
  template [[host_name(VM_KERNEL_NAME_MAMBA2(DT))]] [[kernel]]                               \
  decltype(mamba2_scan<T>) mamba2_scan<T>;

VM_MAMBA2_INSTANCES(M2_INSTANTIATE)
