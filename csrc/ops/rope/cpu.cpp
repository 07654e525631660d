// The CPU rotary_embedding driver (see cpu.h).

#include "ops/rope/cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/elem.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many head elements per call the rotation runs on the calling thread alone.
constexpr int64_t kParallelWork = 1 << 16;
// Tokens per work item (each loads its cos/sin row once for all heads).
constexpr int64_t kTokenBlock = 8;

// Per thread: the widened cos/sin row of the current token and one head's rotated halves.
struct Scratch {
  std::vector<float> cos_sin, x;
};

int64_t position(const RopeArgs& a, int64_t t) {
  const int64_t p = a.positions_64
                        ? static_cast<const int64_t*>(a.positions)[t * a.positions_stride]
                        : static_cast<const int32_t*>(a.positions)[t * a.positions_stride];
  return std::clamp<int64_t>(p, 0, a.max_position - 1);
}

// One head row. Every rotated element is loaded (widened) before any is stored, so `out` may be
// `in`; the loops run over contiguous (neox) or pairwise-interleaved (GPT-J) elements and
// vectorise.
template <typename E, bool kNeox>
void rotate_row(const typename E::T* in, typename E::T* out, int64_t half, int64_t pass,
                const float* cos, const float* sin, float* x1, float* x2) {
  for (int64_t j = 0; j < half; ++j) {
    x1[j] = E::load(in[kNeox ? j : 2 * j]);
    x2[j] = E::load(in[kNeox ? half + j : 2 * j + 1]);
  }
  for (int64_t j = 0; j < half; ++j) {
    out[kNeox ? j : 2 * j] = E::store(x1[j] * cos[j] - x2[j] * sin[j]);
    out[kNeox ? half + j : 2 * j + 1] = E::store(x2[j] * cos[j] + x1[j] * sin[j]);
  }
  if (pass > 0 && out != in) std::memcpy(out + 2 * half, in + 2 * half, pass * sizeof(*in));
}

template <typename E, typename CE, bool kNeox>
void run(const RopeArgs& a) {
  using T = typename E::T;
  using C = typename CE::T;
  const int64_t half = a.rotary_dim / 2, pass = a.head_size - a.rotary_dim;
  const C* cache = static_cast<const C*>(a.cos_sin_cache);
  const int64_t items = (a.num_tokens + kTokenBlock - 1) / kTokenBlock;
  const int64_t work = a.num_tokens * (a.query.num_heads + a.key.num_heads) * a.head_size;

  auto body = [&](int64_t item, Scratch& s) {
    s.cos_sin.resize(2 * half);
    s.x.resize(2 * half);
    float* cos = s.cos_sin.data();
    float* sin = cos + half;
    const int64_t t1 = std::min(a.num_tokens, (item + 1) * kTokenBlock);
    for (int64_t t = item * kTokenBlock; t < t1; ++t) {
      const C* row = cache + position(a, t) * a.cache_stride;
      for (int64_t j = 0; j < half; ++j) {
        cos[j] = CE::load(row[j]);
        sin[j] = CE::load(row[half + j]);
      }
      for (const RopeTensor* x : {&a.query, &a.key}) {
        if (x->num_heads == 0) continue;
        const T* in = static_cast<const T*>(x->in) + t * x->stride_token;
        T* out = static_cast<T*>(x->out) + t * x->out_stride_token;
        for (int64_t h = 0; h < x->num_heads; ++h) {
          rotate_row<E, kNeox>(in + h * x->stride_head, out + h * x->out_stride_head, half, pass,
                               cos, sin, s.x.data(), s.x.data() + half);
        }
      }
    }
  };
  for_each_item<Scratch>(items, work, kParallelWork, body);
}

}  // namespace

void rotary_embedding(const RopeArgs& a) {
  if (a.num_tokens <= 0 || a.max_position <= 0) return;
  dispatch_elem(a.dtype, [&](auto e) {
    dispatch_elem(a.cache_dtype, [&](auto c) {
      if (a.is_neox) {
        run<decltype(e), decltype(c), true>(a);
      } else {
        run<decltype(e), decltype(c), false>(a);
      }
    });
  });
}

}  // namespace vllm_metal::cpu
