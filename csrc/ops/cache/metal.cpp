// ReshapeAndCache::eval_gpu: writes the step's K/V rows into the aliased pools with one kernel.
#include <string>

#include "common/metal_library.h"
#include "ops/cache/op.h"
#include "ops/cache/plan.h"

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

  const metal_args::ReshapeAndCacheParams p = reshape_and_cache_metal_args(*this, inputs);

  const CacheLaunch launch = select_reshape_and_cache_kernel(
      metal::dtype_tag(key.dtype()), p.num_kv_heads, p.head_dim, kv_format != cpu::KvFormat::same);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(key, RC_BUF_KEY);
  enc.set_input_array(value, RC_BUF_VALUE);
  enc.set_output_array(outputs[0], RC_BUF_KEY_CACHE);
  enc.set_output_array(outputs[1], RC_BUF_VALUE_CACHE);
  enc.set_input_array(slots, RC_BUF_SLOT_MAPPING);
  enc.set_bytes(p, RC_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(num_tokens, 1, 1), MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
