// reshape_and_cache: the op builder and eval_cpu, which binds the output pools to the input pools
// (so a step's cache write costs only the rows it writes) and hands plain pointers to the driver.

#include "ops/cache/op.h"

#include <memory>
#include <stdexcept>

#include "common/array_utils.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/cache/cpu.h"

namespace vllm_metal {

cpu::CacheWriteArgs write_args(const mx::array& src, mx::array& dst, const int64_t* slots) {
  return cpu::write_args(cpu::strided(src), cpu::strided(dst), slots,
                         static_cast<int64_t>(src.itemsize()));
}

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
                                                  const std::string& kv_cache_dtype,
                                                  float k_scale, float v_scale,
                                                  mx::StreamOrDevice s) {
  const cpu::KvFormat kv_format = cpu::kv_format_of(kv_cache_dtype, "reshape_and_cache");
  // As in paged_attention's builder: fp8 pools are uint8 and pools of rows are the rows' dtype,
  // so no caller can have floats written as bytes or bytes as floats.
  const mx::Dtype pool_dtype = kv_format == cpu::KvFormat::same ? key.dtype() : mx::uint8;
  if (key_cache.dtype() != pool_dtype || value_cache.dtype() != pool_dtype ||
      value.dtype() != key.dtype()) {
    throw std::invalid_argument(
        "reshape_and_cache: key_cache and value_cache must have the rows' dtype, or be uint8 "
        "with an fp8 kv_cache_dtype");
  }
  auto outputs = mx::array::make_arrays(
      {key_cache.shape(), value_cache.shape()}, {key_cache.dtype(), value_cache.dtype()},
      std::make_shared<ReshapeAndCache>(mx::to_stream(s), kv_format, k_scale, v_scale),
      {key, value, key_cache, value_cache, slot_mapping});
  return {outputs[0], outputs[1]};
}

metal_args::ReshapeAndCacheParams reshape_and_cache_metal_args(
    const ReshapeAndCache& op, const std::vector<mx::array>& inputs) {
  const mx::array& key = inputs[0];
  const mx::array& value = inputs[1];
  const mx::array& key_cache = inputs[2];
  return {
      .num_tokens = key.shape(0),
      .num_kv_heads = key.shape(1),
      .head_dim = key.shape(2),
      .num_slots = static_cast<int64_t>(key_cache.shape(0)) * key_cache.shape(1),
      .key_stride_token = key.strides(0),
      .key_stride_head = key.strides(1),
      .value_stride_token = value.strides(0),
      .value_stride_head = value.strides(1),
      .kv_stride_block = key_cache.strides(0),
      .kv_stride_slot = key_cache.strides(1),
      .kv_stride_head = key_cache.strides(2),
      .block_size = key_cache.shape(1),
      .kv_format = static_cast<int>(op.kv_format),
      .k_scale = op.k_scale,
      .v_scale = op.v_scale,
  };
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

  cpu::CacheWriteArgs wk = write_args(key, outputs[0], slots.data<int64_t>());
  cpu::CacheWriteArgs wv = write_args(value, outputs[1], slots.data<int64_t>());
  if (kv_format != cpu::KvFormat::same) {
    const cpu::ElemType type = cpu::elem_type(key.dtype());
    wk = cpu::quantized(wk, kv_format, type, k_scale);
    wv = cpu::quantized(wv, kv_format, type, v_scale);
  }
  encoder.dispatch([wk, wv]() { cpu::reshape_and_cache(wk, wv); });
}

}  // namespace vllm_metal
