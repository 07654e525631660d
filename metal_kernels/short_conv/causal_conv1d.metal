// The causal depthwise convolution of each sequence continued from its window, with SiLU, and the
// sequences' new windows (float32 sums).
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers, an inline helper taking
// `device` pointers, uint3 [[threadgroup_position_in_grid]], uint
// [[thread_index_in_threadgroup]], uint [[threads_per_threadgroup]], metal::exp, half / bfloat /
// float.
//
// Grid: (ceil(C / threads), T + S * (K - 1)) threadgroups; the host uses
// min(VM_SHORT_CONV_MAX_THREADS, round_up(C, 32)) threads. Thread i of threadgroup (x, r) owns
// channel c = x * threads + i of row r. With u_s a sequence's window followed by its tokens:
// row r < T is token r of sequence s (cu_seqlens[s] <= r < cu_seqlens[s + 1], found by binary
// search), y[r, c] = silu(b[c] + sum_j weight[c, j] u_s[r - cu_seqlens[s] + j]), b the bias when
// p.has_bias (else 0); row T + s (K - 1) + e is entry e of sequence s's new window,
// u_s[len_s + e]. A token row outside every sequence is zero.

#include <metal_stdlib>

#include "constants.h"
#include "ops/short_conv/params.h"

using namespace metal;

// Entry u of sequence s's window-then-tokens, channel c.
template <typename T>
inline float window_input(const device T* x, const device T* conv_state,
                          constant CausalConv1dParams& p, int s, int begin, int u, int c) {
  const int keep = p.width - 1;
  const long row = u < keep ? long(s) * keep + u : long(begin + u - keep);
  return float(u < keep ? conv_state[row * p.channels + c] : x[row * p.channels + c]);
}

template <typename T>
[[kernel]] void causal_conv1d(
    const device T* x [[buffer(SC_BUF_X)]],
    const device T* weight [[buffer(SC_BUF_WEIGHT)]],
    const device T* conv_state [[buffer(SC_BUF_CONV_STATE)]],
    const device int* cu_seqlens [[buffer(SC_BUF_CU_SEQLENS)]],
    const device T* bias [[buffer(SC_BUF_BIAS)]],
    device T* out [[buffer(SC_BUF_OUT)]],
    device T* state_out [[buffer(SC_BUF_STATE_OUT)]],
    constant CausalConv1dParams& p [[buffer(SC_BUF_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint num_threads [[threads_per_threadgroup]]) {
  const int c = int(tg.x) * int(num_threads) + int(tid);
  const int r = int(tg.y);
  const int keep = p.width - 1;
  if (c >= p.channels) {
    return;
  }
  if (r >= p.num_tokens) {  // a new-window entry
    const int s = (r - p.num_tokens) / keep;
    const int e = (r - p.num_tokens) - s * keep;
    if (s >= p.num_seqs) {
      return;
    }
    const int begin = clamp(cu_seqlens[s], 0, p.num_tokens);
    const int len = clamp(cu_seqlens[s + 1], begin, p.num_tokens) - begin;
    const T u = T(window_input(x, conv_state, p, s, begin, len + e, c));
    state_out[(long(s) * keep + e) * p.channels + c] = u;
    return;
  }
  // The last sequence starting at or before token r.
  int lo = 0;
  int hi = p.num_seqs;  // invariant: cu_seqlens[lo] <= r or lo == 0; answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu_seqlens[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int s = lo;
  float acc = 0.0f;
  if (p.num_seqs > 0 && cu_seqlens[s] <= r && r < cu_seqlens[s + 1]) {
    const int begin = cu_seqlens[s];
    acc = p.has_bias ? float(bias[c]) : 0.0f;
    for (int j = 0; j < p.width; ++j) {
      const float w = float(weight[long(c) * p.width + j]);
      acc += w * window_input(x, conv_state, p, s, begin, r - begin + j, c);
    }
    acc = acc / (1.0f + metal::exp(-acc));  // silu
  }
  out[long(r) * p.channels + c] = T(acc);
}

// Instances: VM_SHORT_CONV_INSTANCES of constants.h.
#define SC_INSTANTIATE(DT, T, BYTES)                                                         \
  template [[host_name(VM_KERNEL_NAME_SHORT_CONV(DT))]] [[kernel]]                           \
  decltype(causal_conv1d<T>) causal_conv1d<T>;

VM_SHORT_CONV_INSTANCES(SC_INSTANTIATE)
