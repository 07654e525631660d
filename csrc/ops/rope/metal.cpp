// RotaryEmbedding::eval_gpu: one kernel, one thread per (token, head, element pair); query and key
// are read in place through their strides, the outputs are new contiguous buffers.
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/rope/op.h"
#include "ops/rope/plan.h"

namespace vllm_metal {

void RotaryEmbedding::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  using metal::require;
  const mx::array& positions = inputs[0];
  const mx::array& query = inputs[1];
  const mx::array& key = inputs[2];
  const mx::array& cache = inputs[3];
  require(positions.flags().row_contiguous && cache.flags().row_contiguous, "rotary_embedding",
          "positions and cos_sin_cache must be contiguous");
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  if (outputs[0].size() == 0 && outputs[1].size() == 0) return;

  const metal_args::RotaryEmbeddingParams p = rotary_embedding_metal_args(*this, inputs);
  const RopeLaunch launch = select_rotary_embedding_kernel(
      metal::dtype_tag(query.dtype()), metal::dtype_tag(cache.dtype()),
      positions.dtype() == mx::int64 ? "i64" : "i32", p.num_tokens,
      p.num_q_heads + p.num_kv_heads, p.head_size);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(positions, ROPE_BUF_POSITIONS);
  // A tensor without heads is never read or written; the other one stands in for its binding.
  enc.set_input_array(query.size() ? query : key, ROPE_BUF_QUERY);
  enc.set_input_array(key.size() ? key : query, ROPE_BUF_KEY);
  enc.set_input_array(cache, ROPE_BUF_COS_SIN_CACHE);
  enc.set_output_array(outputs[0].size() ? outputs[0] : outputs[1], ROPE_BUF_QUERY_OUT);
  enc.set_output_array(outputs[1].size() ? outputs[1] : outputs[0], ROPE_BUF_KEY_OUT);
  enc.set_bytes(p, ROPE_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
