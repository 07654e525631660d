// The CPU reshape_and_cache driver (see cpu.h).

#include "ops/cache/cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/per_token_head.h"
#include "common/thread_pool.h"

namespace vllm_metal::cpu {

namespace {

// Below this many bytes per call the write runs on the calling thread alone.
constexpr int64_t kParallelBytes = 1 << 20;

// One row of `n` elements of type E (stride src_d) stored as fp8 bytes (stride dst_d).
template <typename E>
void quantize_row(const typename E::T* src, int64_t src_d, uint8_t* dst, int64_t dst_d, int64_t n,
                  int format, float scale) {
  for (int64_t d = 0; d < n; ++d) {
    const float a = E::load(src[d * src_d]) / scale;
    dst[d * dst_d] = static_cast<uint8_t>(vm_fp8_from_float(a, format));
  }
}

// One row of `n` elements of type E (stride src_d) stored as a per-token-head row: its element
// bytes and then the row's float32 scale (common/per_token_head.h), each byte dst_d apart.
// An int4 row (already rotated): n / 2 bytes of two levels, then the stored scale with the zero
// point in its low bits (common/per_token_head.h).
template <typename E>
void quantize_int4_row(const typename E::T* src, int64_t src_d, uint8_t* dst, int64_t dst_d,
                       int64_t n) {
  float low = E::load(src[0]), high = low;
  for (int64_t d = 1; d < n; ++d) {
    const float x = E::load(src[d * src_d]);
    low = std::min(low, x);
    high = std::max(high, x);
  }
  const float scale = vm_pth_int4_scale_of(low, high);
  const vm_u32 zp = vm_pth_int4_zero(low, scale);
  const float inv = vm_pth_inverse(scale);
  for (int64_t d = 0; d + 1 < n; d += 2) {
    const vm_u32 even = vm_pth_int4_store(E::load(src[d * src_d]), inv, zp);
    const vm_u32 odd = vm_pth_int4_store(E::load(src[(d + 1) * src_d]), inv, zp);
    dst[d / 2 * dst_d] = static_cast<uint8_t>(even | (odd << 4));
  }
  const float stored = vm_pth_int4_stored_scale(scale, zp);
  for (int i = 0; i < VM_PTH_SCALE_BYTES; ++i) {
    dst[(n / 2 + i) * dst_d] = static_cast<uint8_t>(vm_pth_scale_byte(stored, i));
  }
}

template <typename E>
void quantize_pth_row(const typename E::T* src, int64_t src_d, uint8_t* dst, int64_t dst_d,
                      int64_t n, int format) {
  if (vm_pth_int4(format)) return quantize_int4_row<E>(src, src_d, dst, dst_d, n);
  float absmax = 0.0f;
  for (int64_t d = 0; d < n; ++d) absmax = std::max(absmax, std::fabs(E::load(src[d * src_d])));
  const float scale = vm_pth_scale_of(absmax, format);
  const float inv = vm_pth_inverse(scale);
  for (int64_t d = 0; d < n; ++d) {
    dst[d * dst_d] = static_cast<uint8_t>(vm_pth_store(E::load(src[d * src_d]), inv, format));
  }
  for (int i = 0; i < VM_PTH_SCALE_BYTES; ++i) {
    dst[(n + i) * dst_d] = static_cast<uint8_t>(vm_pth_scale_byte(scale, i));
  }
}

void quantize_rows(const CacheWriteArgs& w, int64_t t_begin, int64_t t_end) {
  dispatch_elem(w.src_type, [&](auto elem) {
    using E = decltype(elem);
    using T = typename E::T;
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t slot = w.slots[t];
      if (slot < 0 || slot >= w.num_slots) continue;
      const int64_t block = slot / w.block_size, offset = slot % w.block_size;
      for (int64_t h = 0; h < w.num_heads; ++h) {
        const T* src = reinterpret_cast<const T*>(w.src) + t * w.src_stride_t + h * w.src_stride_h;
        uint8_t* dst = reinterpret_cast<uint8_t*>(w.dst) + block * w.dst_stride_b +
                       offset * w.dst_stride_o + h * w.dst_stride_h;
        if (per_token_head(w.kv_format)) {
          quantize_pth_row<E>(src, w.src_stride_d, dst, w.dst_stride_d, w.head_dim,
                              static_cast<int>(w.kv_format));
        } else {
          quantize_row<E>(src, w.src_stride_d, dst, w.dst_stride_d, w.head_dim,
                          static_cast<int>(w.kv_format), w.scale);
        }
      }
    }
  });
}

void write_rows(const CacheWriteArgs& w, int64_t t_begin, int64_t t_end) {
  if (w.kv_format != KvFormat::same) return quantize_rows(w, t_begin, t_end);
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

// Writes every pool's rows, on the calling thread or (large writes) the pool.
void write_pools(const CacheWriteArgs* const* pools, int num_pools) {
  auto& thread_pool = ThreadPool::instance();
  int64_t bytes = 0;
  for (int i = 0; i < num_pools; ++i) {
    const CacheWriteArgs& w = *pools[i];
    bytes += w.num_tokens * w.num_heads * w.head_dim * w.itemsize;
  }
  if (bytes < kParallelBytes || thread_pool.num_threads() == 1) {
    for (int i = 0; i < num_pools; ++i) write_rows(*pools[i], 0, pools[i]->num_tokens);
    return;
  }
  const int64_t chunks = 4 * thread_pool.num_threads();
  thread_pool.parallel_for(num_pools * chunks, [&](int64_t i, int) {
    const CacheWriteArgs& w = *pools[i / chunks];
    const int64_t per = (w.num_tokens + chunks - 1) / chunks;
    const int64_t t0 = std::min(w.num_tokens, (i % chunks) * per);
    const int64_t t1 = std::min(w.num_tokens, t0 + per);
    write_rows(w, t0, t1);
  }, thread_pool.num_threads());
}

}  // namespace

CacheWriteArgs write_args(const Strided& src, const Strided& dst, const int64_t* slots,
                          int64_t itemsize) {
  const bool heads = src.ndim == 3;  // else one head and no head axis (a latent cache)
  const int last_src = src.ndim - 1, last_dst = dst.ndim - 1;
  return {
      .src = static_cast<const char*>(src.data),
      .dst = static_cast<char*>(dst.data),
      .slots = slots,
      .num_tokens = src.shape[0],
      .num_heads = heads ? src.shape[1] : 1,
      .head_dim = src.shape[last_src],
      .block_size = dst.shape[1],
      .num_slots = dst.shape[0] * dst.shape[1],
      .itemsize = itemsize,
      .src_stride_t = src.strides[0],
      .src_stride_h = heads ? src.strides[1] : 0,
      .src_stride_d = src.strides[last_src],
      .dst_stride_b = dst.strides[0],
      .dst_stride_o = dst.strides[1],
      .dst_stride_h = heads ? dst.strides[2] : 0,
      .dst_stride_d = dst.strides[last_dst],
  };
}

CacheWriteArgs quantized(CacheWriteArgs args, KvFormat format, ElemType type, float scale) {
  args.kv_format = format;
  args.src_type = type;
  args.scale = scale;
  return args;
}

void reshape_and_cache(const CacheWriteArgs& key, const CacheWriteArgs& value) {
  const CacheWriteArgs* pools[] = {&key, &value};
  write_pools(pools, 2);
}

void write_cache(const CacheWriteArgs& rows) {
  const CacheWriteArgs* pools[] = {&rows};
  write_pools(pools, 1);
}

}  // namespace vllm_metal::cpu
