// The CPU mamba2_scan driver (see cpu.h).

#include "ops/mamba2/cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/elem.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many multiply-adds per call the recurrence runs on the calling thread alone.
constexpr int64_t kParallelWork = 1 << 18;

// One (sequence, head): the state rows [P, N] stepped over the sequence's tokens.
template <typename E>
void run_head(const Mamba2Args& a, int64_t s, int64_t h, std::vector<float>& scratch) {
  using T = typename E::T;
  const int64_t P = a.head_dim, N = a.state_dim, H = a.num_heads, G = a.num_groups;
  const int64_t g = h / (H / G);
  const int64_t T_ = a.num_tokens;
  const int64_t t0 = std::clamp<int64_t>(a.cu_seqlens[s], 0, T_);
  const int64_t t1 = std::clamp<int64_t>(a.cu_seqlens[s + 1], t0, T_);
  float* S = a.state_out + (s * H + h) * P * N;
  std::memcpy(S, a.state + (s * H + h) * P * N, P * N * sizeof(float));
  scratch.resize(2 * N);
  float* bf = scratch.data();
  float* cf = bf + N;
  const T* x = static_cast<const T*>(a.x);
  const T* B = static_cast<const T*>(a.B);
  const T* C = static_cast<const T*>(a.C);
  T* out = static_cast<T*>(a.out);
  const float A = a.A[h], D = a.D[h];
  for (int64_t t = t0; t < t1; ++t) {
    const T* bt = B + (t * G + g) * N;
    const T* ct = C + (t * G + g) * N;
    for (int64_t n = 0; n < N; ++n) bf[n] = E::load(bt[n]), cf[n] = E::load(ct[n]);
    const float dt = a.dt[t * H + h];
    const float decay = std::exp(dt * A);
    const T* xt = x + (t * H + h) * P;
    T* yt = out + (t * H + h) * P;
    for (int64_t p = 0; p < P; ++p) {
      float* row = S + p * N;
      const float xp = E::load(xt[p]);
      const float dx = dt * xp;
      // S = exp(dt A) S + dt x B; y = S C + D x
      for (int64_t n = 0; n < N; ++n) row[n] = decay * row[n] + dx * bf[n];
      yt[p] = E::store(dot(row, cf, N) + D * xp);
    }
  }
}

template <typename E>
void run(const Mamba2Args& a) {
  const int64_t work = a.num_tokens * a.num_heads * a.head_dim * a.state_dim;
  for_each_item<std::vector<float>>(
      a.num_seqs * a.num_heads, work, kParallelWork, [&](int64_t i, std::vector<float>& scratch) {
        run_head<E>(a, i / a.num_heads, i % a.num_heads, scratch);
      });
}

}  // namespace

void mamba2_scan(const Mamba2Args& a) {
  std::memset(a.out, 0, a.num_tokens * a.num_heads * a.head_dim * elem_size(a.dtype));
  dispatch_elem(a.dtype, [&](auto e) { run<decltype(e)>(a); });
}

}  // namespace vllm_metal::cpu
