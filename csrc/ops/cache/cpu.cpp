// The CPU reshape_and_cache driver (see cpu.h).

#include "ops/cache/cpu.h"

#include <algorithm>
#include <cstring>

#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many bytes per call the write runs on the calling thread alone.
constexpr int64_t kParallelBytes = 1 << 20;

void write_rows(const CacheWriteArgs& w, int64_t t_begin, int64_t t_end) {
  const int64_t isz = w.itemsize;
  const bool rows_contiguous = w.src_stride_d == 1 && w.dst_stride_d == 1;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const int64_t slot = w.slots[t];
    if (slot < 0 || slot >= w.num_slots) continue;  // padding (or out of range: skipped)
    const int64_t block = slot / w.block_size, offset = slot % w.block_size;
    for (int64_t h = 0; h < w.num_heads; ++h) {
      const char* src = w.src + (t * w.src_stride_t + h * w.src_stride_h) * isz;
      char* dst =
          w.dst + (block * w.dst_stride_b + offset * w.dst_stride_o + h * w.dst_stride_h) * isz;
      if (rows_contiguous) {
        std::memcpy(dst, src, w.head_dim * isz);
      } else {
        for (int64_t d = 0; d < w.head_dim; ++d) {
          std::memcpy(dst + d * w.dst_stride_d * isz, src + d * w.src_stride_d * isz, isz);
        }
      }
    }
  }
}

}  // namespace

void reshape_and_cache(const CacheWriteArgs& key, const CacheWriteArgs& value) {
  auto& pool = ThreadPool::instance();
  const int64_t bytes = 2 * key.num_tokens * key.num_heads * key.head_dim * key.itemsize;
  if (bytes < kParallelBytes || pool.num_threads() == 1) {
    write_rows(key, 0, key.num_tokens);
    write_rows(value, 0, value.num_tokens);
    return;
  }
  const int64_t chunks = 4 * pool.num_threads();
  const int64_t per = (key.num_tokens + chunks - 1) / chunks;
  pool.parallel_for(2 * chunks, [&](int64_t i, int) {
    const CacheWriteArgs& w = i < chunks ? key : value;
    const int64_t c = i % chunks;
    const int64_t t0 = std::min(w.num_tokens, c * per);
    const int64_t t1 = std::min(w.num_tokens, t0 + per);
    write_rows(w, t0, t1);
  }, pool.num_threads());
}

}  // namespace vllm_metal::cpu
