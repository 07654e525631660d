// MlaAttention::eval_gpu and MlaReshapeAndCache::eval_gpu: one kernel each (plan.h).
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/cache/op.h"
#include "ops/mla/op.h"
#include "ops/mla/plan.h"

namespace vllm_metal {

void MlaAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  using metal::require;
  const mx::array& query = inputs[0];
  const mx::array& cache = inputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;

  require(query.strides(2) == 1, "mla_attention", "query needs a contiguous latent axis");
  require(cache.strides(2) == 1, "mla_attention", "latent_cache needs a contiguous latent axis");
  for (int i = 2; i < 5; ++i) {
    require(inputs[i].flags().row_contiguous, "mla_attention",
            "block_tables, seq_lens and cu_seqlens_q must be contiguous");
  }
  const metal_args::MlaAttentionParams p = mla_attention_metal_args(*this, inputs);
  const MlaLaunch launch = select_mla_attention_kernel(
      metal::dtype_tag(query.dtype()), p.num_heads, query.shape(2), value_dim, p.num_tokens);

  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(query, MLA_BUF_QUERY);
  enc.set_input_array(cache, MLA_BUF_LATENT_CACHE);
  enc.set_input_array(inputs[2], MLA_BUF_BLOCK_TABLES);
  enc.set_input_array(inputs[3], MLA_BUF_SEQ_LENS);
  enc.set_input_array(inputs[4], MLA_BUF_CU_SEQLENS_Q);
  enc.set_output_array(out, MLA_BUF_OUT);
  enc.set_bytes(p, MLA_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

void MlaReshapeAndCache::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  using metal::require;
  const mx::array& latent = inputs[0];
  const mx::array& cache = inputs[1];
  const mx::array& slots = inputs[2];
  require(pool_is_aliasable(cache), "mla_reshape_and_cache",
          "latent_cache must be writable in place (not a broadcast or overlapping view)");
  require(cache.strides(2) == 1 && latent.strides(1) == 1, "mla_reshape_and_cache",
          "latent and latent_cache need a contiguous latent axis");
  require(slots.flags().row_contiguous, "mla_reshape_and_cache",
          "slot_mapping must be contiguous");
  out.copy_shared_buffer(cache);
  if (latent.size() == 0) return;

  const metal_args::MlaReshapeAndCacheParams p = mla_reshape_and_cache_metal_args(inputs);
  const MlaLaunch launch = select_mla_reshape_and_cache_kernel(metal::dtype_tag(latent.dtype()),
                                                               p.latent_dim, p.num_tokens);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(latent, MLC_BUF_LATENT);
  enc.set_output_array(out, MLC_BUF_LATENT_CACHE);
  enc.set_input_array(slots, MLC_BUF_SLOT_MAPPING);
  enc.set_bytes(p, MLC_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
