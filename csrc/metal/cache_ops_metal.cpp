// ReshapeAndCache::eval_gpu: writes the step's K/V rows into the aliased pools with one kernel.
#include <string>

#define VLLM_METAL_HOST
#include "../../metal_kernels/attention_params.h"
#include "kernel_select.h"
#include "metal/metal_library.h"
#include "ops.h"

namespace vllm_metal {

void ReshapeAndCache::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  using metal::require;
  const mx::array& key = inputs[0];
  const mx::array& value = inputs[1];
  const mx::array& key_cache = inputs[2];
  const mx::array& value_cache = inputs[3];
  const mx::array& slots = inputs[4];
  require(pool_is_aliasable(key_cache) && pool_is_aliasable(value_cache), "reshape_and_cache",
          "the K/V pools must be writable in place (not broadcast or overlapping views)");
  require(key_cache.strides() == value_cache.strides() && key_cache.strides(3) == 1,
          "reshape_and_cache", "key_cache and value_cache need equal strides, head_dim contiguous");
  require(key.strides(2) == 1 && value.strides(2) == 1, "reshape_and_cache",
          "key and value need a contiguous head_dim axis");
  require(slots.flags().row_contiguous, "reshape_and_cache", "slot_mapping must be contiguous");
  outputs[0].copy_shared_buffer(key_cache);
  outputs[1].copy_shared_buffer(value_cache);
  const int num_tokens = key.shape(0);
  if (num_tokens == 0 || key.size() == 0) return;

  metal_args::ReshapeAndCacheParams p{};
  p.num_tokens = num_tokens;
  p.num_kv_heads = key.shape(1);
  p.head_dim = key.shape(2);
  p.block_size = key_cache.shape(1);
  p.num_slots = static_cast<int64_t>(key_cache.shape(0)) * key_cache.shape(1);
  p.key_stride_token = key.strides(0);
  p.key_stride_head = key.strides(1);
  p.value_stride_token = value.strides(0);
  p.value_stride_head = value.strides(1);
  p.kv_stride_block = key_cache.strides(0);
  p.kv_stride_slot = key_cache.strides(1);
  p.kv_stride_head = key_cache.strides(2);

  const CacheLaunch launch =
      select_reshape_and_cache_kernel(metal::dtype_tag(key.dtype()), p.num_kv_heads, p.head_dim);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(key, 0);
  enc.set_input_array(value, 1);
  enc.set_output_array(outputs[0], 2);
  enc.set_output_array(outputs[1], 3);
  enc.set_input_array(slots, 4);
  enc.set_bytes(p, 5);
  enc.dispatch_threadgroups(MTL::Size(num_tokens, 1, 1), MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
