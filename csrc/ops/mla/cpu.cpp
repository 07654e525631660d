// The CPU mla_attention driver (see cpu.h).

#include "ops/mla/cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/elem.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many multiply-adds per call the op runs on the calling thread alone.
constexpr int64_t kParallelWork = 1 << 18;
// Latent rows widened per tile: every head's logits of a tile are taken before its softmax step.
constexpr int64_t kKeyTile = 16;

// Where a token sits: its sequence (-1: none) and position.
struct TokenPlace {
  int64_t seq = -1;
  int64_t pos = 0;
};

// One token's heads [h0, h1): logits against each attended latent row, online softmax, output.
template <typename E>
void run_item(const MlaAttentionArgs& a, const TokenPlace& place, int64_t t, int64_t h0,
              int64_t h1, std::vector<float>& scratch) {
  using T = typename E::T;
  const int64_t D = a.latent_dim, DV = a.value_dim, H = a.num_heads, nh = h1 - h0;
  T* out = static_cast<T*>(a.out) + (t * H + h0) * DV;
  if (place.seq < 0) {
    std::memset(static_cast<void*>(out), 0, nh * DV * sizeof(T));
    return;
  }
  const int64_t n_keys = std::clamp<int64_t>(place.pos + 1, 0, a.max_blocks * a.block_size);

  scratch.resize(nh * D + nh * DV + 2 * nh + kKeyTile * D + kKeyTile);
  float* q = scratch.data();
  float* acc = q + nh * D;
  float* m = acc + nh * DV;
  float* l = m + nh;
  float* tile = l + nh;
  float* logit = tile + kKeyTile * D;

  const T* query = static_cast<const T*>(a.query) + (t * H + h0) * D;
  for (int64_t i = 0; i < nh * D; ++i) q[i] = E::load(query[i]);
  std::fill(acc, acc + nh * DV, 0.0f);
  std::fill(m, m + nh, -INFINITY);
  std::fill(l, l + nh, 0.0f);

  const T* cache = static_cast<const T*>(a.latent_cache);
  const int32_t* table = a.block_tables + place.seq * a.max_blocks;
  for (int64_t k0 = 0; k0 < n_keys; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, n_keys - k0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t k = k0 + j;
      const int64_t block = table[k / a.block_size];
      float* row = tile + j * D;
      if (block < 0 || block >= a.num_blocks) {
        std::fill(row, row + D, 0.0f);
        continue;
      }
      const T* src = cache + block * a.cache_stride_b + (k % a.block_size) * D;
      for (int64_t d = 0; d < D; ++d) row[d] = E::load(src[d]);
    }
    for (int64_t h = 0; h < nh; ++h) {
      const float* qh = q + h * D;
      float tile_max = -INFINITY;
      for (int64_t j = 0; j < nk; ++j) {
        logit[j] = dot(qh, tile + j * D, D) * a.scale;
        tile_max = std::max(tile_max, logit[j]);
      }
      const float m_new = std::max(m[h], tile_max);
      const float factor = std::exp(m[h] - m_new);  // 0 on the first tile (m = -inf)
      float* o = acc + h * DV;
      if (factor != 1.0f) {
        for (int64_t d = 0; d < DV; ++d) o[d] *= factor;
      }
      float sum = l[h] * factor;
      for (int64_t j = 0; j < nk; ++j) {
        const float w = std::exp(logit[j] - m_new);
        sum += w;
        const float* v = tile + j * D;
        for (int64_t d = 0; d < DV; ++d) o[d] += w * v[d];
      }
      l[h] = sum;
      m[h] = m_new;
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    for (int64_t d = 0; d < DV; ++d) out[h * DV + d] = E::store(acc[h * DV + d] * inv);
  }
}

template <typename E>
void run(const MlaAttentionArgs& a) {
  const int64_t T_ = a.num_tokens, H = a.num_heads;
  std::vector<TokenPlace> places(static_cast<size_t>(T_));
  int64_t work = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t c0 = std::clamp<int64_t>(a.cu_seqlens_q[s], 0, T_);
    const int64_t c1 = std::clamp<int64_t>(a.cu_seqlens_q[s + 1], c0, T_);
    const int64_t first = static_cast<int64_t>(a.seq_lens[s]) - (c1 - c0);
    for (int64_t t = c0; t < c1; ++t) {
      places[t] = TokenPlace{s, first + (t - c0)};
      work += std::max<int64_t>(0, first + (t - c0) + 1);
    }
  }
  work *= H * (a.latent_dim + a.value_dim);
  // Few tokens (decode) leave threads idle: split the heads of a token into groups, at the cost of
  // widening its rows once per group.
  const int64_t threads = ThreadPool::instance().num_threads();
  const int64_t groups =
      work < kParallelWork ? 1 : std::clamp<int64_t>((2 * threads + T_ - 1) / T_, 1, H);
  for_each_item<std::vector<float>>(
      T_ * groups, work, kParallelWork, [&](int64_t i, std::vector<float>& scratch) {
        const int64_t t = i / groups, g = i % groups;
        run_item<E>(a, places[t], t, H * g / groups, H * (g + 1) / groups, scratch);
      });
}

}  // namespace

void mla_attention(const MlaAttentionArgs& a) {
  if (a.num_tokens == 0 || a.num_heads == 0) return;
  dispatch_elem(a.dtype, [&](auto e) { run<decltype(e)>(a); });
}

}  // namespace vllm_metal::cpu
