// The CPU gated_delta_rule driver (see cpu.h).

#include "ops/gated_delta/cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/elem.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many multiply-adds per call the recurrence runs on the calling thread alone.
constexpr int64_t kParallelWork = 1 << 18;

// One (sequence, value head): the state rows [Dv, Dk] stepped over the sequence's tokens.
template <typename E>
void run_head(const GatedDeltaArgs& a, int64_t s, int64_t h, std::vector<float>& scratch) {
  using T = typename E::T;
  const int64_t Dk = a.key_dim, Dv = a.value_dim, Hk = a.num_k_heads, Hv = a.num_v_heads;
  const int64_t kh = h / (Hv / Hk);
  const int64_t T_ = a.num_tokens;
  const int64_t t0 = std::clamp<int64_t>(a.cu_seqlens[s], 0, T_);
  const int64_t t1 = std::clamp<int64_t>(a.cu_seqlens[s + 1], t0, T_);
  float* S = a.state_out + (s * Hv + h) * Dv * Dk;
  std::memcpy(S, a.state + (s * Hv + h) * Dv * Dk, Dv * Dk * sizeof(float));
  scratch.resize(2 * Dk);
  float* kf = scratch.data();
  float* qf = kf + Dk;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);
  for (int64_t t = t0; t < t1; ++t) {
    const T* kt = k + (t * Hk + kh) * Dk;
    const T* qt = q + (t * Hk + kh) * Dk;
    for (int64_t e = 0; e < Dk; ++e) kf[e] = E::load(kt[e]), qf[e] = E::load(qt[e]);
    const float g = a.g[t * Hv + h], beta = a.beta[t * Hv + h];
    const T* vt = v + (t * Hv + h) * Dv;
    T* yt = out + (t * Hv + h) * Dv;
    for (int64_t i = 0; i < Dv; ++i) {
      float* row = S + i * Dk;
      for (int64_t e = 0; e < Dk; ++e) row[e] *= g;  // S = g S
      const float delta = beta * (E::load(vt[i]) - dot(row, kf, Dk));  // beta (v - S k)
      for (int64_t e = 0; e < Dk; ++e) row[e] += delta * kf[e];
      yt[i] = E::store(dot(row, qf, Dk));  // y = S q
    }
  }
}

template <typename E>
void run(const GatedDeltaArgs& a) {
  const int64_t work = a.num_tokens * a.num_v_heads * a.value_dim * a.key_dim;
  for_each_item<std::vector<float>>(
      a.num_seqs * a.num_v_heads, work, kParallelWork, [&](int64_t i, std::vector<float>& scratch) {
        run_head<E>(a, i / a.num_v_heads, i % a.num_v_heads, scratch);
      });
}

}  // namespace

void gated_delta_rule(const GatedDeltaArgs& a) {
  std::memset(a.out, 0, a.num_tokens * a.num_v_heads * a.value_dim * elem_size(a.dtype));
  dispatch_elem(a.dtype, [&](auto e) { run<decltype(e)>(a); });
}

}  // namespace vllm_metal::cpu
