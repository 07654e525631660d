// reshape_and_cache: the op builder and the CPU body (scatter of K/V rows into the paged pools).
//
// The outputs alias the input pools, so a step's cache write costs only the rows it writes.

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

#include "cpu/array_utils.h"
#include "cpu/thread_pool.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops.h"

namespace vllm_metal {

namespace {

// Below this many bytes per call the write runs on the stream thread alone.
constexpr int64_t kParallelBytes = 1 << 20;

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string shape_str(const mx::array& a) {
  std::ostringstream os;
  os << "(";
  for (size_t i = 0; i < a.ndim(); ++i) os << (i ? ", " : "") << a.shape(i);
  os << (a.ndim() == 1 ? ",)" : ")");
  return os.str();
}

struct WriteArgs {
  const char* src;
  char* dst;
  const int64_t* slots;
  int64_t num_tokens, num_heads, head_dim, block_size, num_slots, itemsize;
  int64_t src_stride_t, src_stride_h, src_stride_d;
  int64_t dst_stride_b, dst_stride_o, dst_stride_h, dst_stride_d;
};

void write_rows(const WriteArgs& w, int64_t t_begin, int64_t t_end) {
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

WriteArgs write_args(const mx::array& src, mx::array& dst, const int64_t* slots) {
  WriteArgs w{};
  w.src = src.data<char>();
  w.dst = dst.data<char>();
  w.slots = slots;
  w.num_tokens = src.shape(0);
  w.num_heads = src.shape(1);
  w.head_dim = src.shape(2);
  w.block_size = dst.shape(1);
  w.num_slots = static_cast<int64_t>(dst.shape(0)) * dst.shape(1);
  w.itemsize = static_cast<int64_t>(src.itemsize());
  w.src_stride_t = src.strides(0);
  w.src_stride_h = src.strides(1);
  w.src_stride_d = src.strides(2);
  w.dst_stride_b = dst.strides(0);
  w.dst_stride_o = dst.strides(1);
  w.dst_stride_h = dst.strides(2);
  w.dst_stride_d = dst.strides(3);
  return w;
}

// The output pool: the input's own buffer when it can be written in place, else a fresh
// row-contiguous copy of it.
void bind_output_pool(const mx::array& pool, mx::array& out, mx::cpu::CommandEncoder& encoder) {
  if (pool_is_aliasable(pool)) {
    out.copy_shared_buffer(pool);
    return;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::vector<int64_t> shape(pool.shape().begin(), pool.shape().end());
  std::vector<int64_t> strides(pool.strides().begin(), pool.strides().end());
  encoder.dispatch([src = pool.data<char>(), dst = out.data<char>(), shape = std::move(shape),
                    strides = std::move(strides), itemsize = pool.itemsize()]() {
    cpu::copy_strided(src, shape, strides, itemsize, dst);
  });
}

}  // namespace

bool pool_is_aliasable(const mx::array& pool) {
  if (pool.flags().row_contiguous) return true;
  // Row-major order with gaps: each axis' stride must step over the whole extent of the axes after
  // it, so distinct indices never share memory.
  int64_t inner_extent = 1;  // elements spanned by the axes after the current one
  for (int i = pool.ndim() - 1; i >= 0; --i) {
    const int64_t n = pool.shape(i), st = pool.strides(i);
    if (n == 1) continue;
    if (st < inner_extent) return false;
    inner_extent = st * (n - 1) + inner_extent;
  }
  return true;
}

std::pair<mx::array, mx::array> reshape_and_cache(const mx::array& key, const mx::array& value,
                                                  const mx::array& key_cache,
                                                  const mx::array& value_cache,
                                                  const mx::array& slot_mapping,
                                                  mx::StreamOrDevice s) {
  if (key.ndim() != 3) fail("key must be [num_tokens, num_kv_heads, head_size], got " + shape_str(key));
  if (value.shape() != key.shape())
    fail("value shape " + shape_str(value) + " differs from key shape " + shape_str(key));
  if (key_cache.ndim() != 4)
    fail("key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got " +
         shape_str(key_cache));
  if (value_cache.shape() != key_cache.shape())
    fail("value_cache shape " + shape_str(value_cache) + " differs from key_cache " +
         shape_str(key_cache));
  if (key_cache.shape(2) != key.shape(1) || key_cache.shape(3) != key.shape(2))
    fail("key_cache " + shape_str(key_cache) + " does not hold rows of key " + shape_str(key));
  if (key.dtype() != key_cache.dtype() || value.dtype() != key_cache.dtype() ||
      value_cache.dtype() != key_cache.dtype())
    fail("key, value, key_cache and value_cache must share one dtype");
  if (slot_mapping.ndim() != 1 || slot_mapping.dtype() != mx::int64 ||
      slot_mapping.shape(0) != key.shape(0))
    fail("slot_mapping must be int64 [num_tokens]");
  auto stream = mx::to_stream(s);
  auto outputs = mx::array::make_arrays(
      {key_cache.shape(), value_cache.shape()}, {key_cache.dtype(), value_cache.dtype()},
      std::make_shared<ReshapeAndCache>(stream),
      {key, value, key_cache, value_cache, slot_mapping});
  return {outputs[0], outputs[1]};
}

void ReshapeAndCache::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array& key = inputs[0];
  const mx::array& value = inputs[1];
  mx::array slots = cpu::row_contiguous(inputs[4], encoder);
  bind_output_pool(inputs[2], outputs[0], encoder);
  bind_output_pool(inputs[3], outputs[1], encoder);
  if (key.shape(0) == 0 || key.size() == 0) return;

  const WriteArgs wk = write_args(key, outputs[0], slots.data<int64_t>());
  const WriteArgs wv = write_args(value, outputs[1], slots.data<int64_t>());
  const int64_t bytes = 2 * static_cast<int64_t>(key.nbytes());
  encoder.dispatch([wk, wv, bytes]() {
    auto& pool = cpu::ThreadPool::instance();
    if (bytes < kParallelBytes || pool.num_threads() == 1) {
      write_rows(wk, 0, wk.num_tokens);
      write_rows(wv, 0, wv.num_tokens);
      return;
    }
    const int64_t chunks = 4 * pool.num_threads();
    const int64_t per = (wk.num_tokens + chunks - 1) / chunks;
    pool.parallel_for(2 * chunks, [&](int64_t i, int) {
      const WriteArgs& w = i < chunks ? wk : wv;
      const int64_t c = i % chunks;
      const int64_t t0 = std::min(w.num_tokens, c * per);
      const int64_t t1 = std::min(w.num_tokens, t0 + per);
      write_rows(w, t0, t1);
    }, pool.num_threads());
  });
}

}  // namespace vllm_metal
