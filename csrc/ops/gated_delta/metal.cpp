// GatedDeltaRule::eval_gpu: one kernel, one simdgroup per (sequence, value head, value row).
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/gated_delta/op.h"
#include "ops/gated_delta/plan.h"

namespace vllm_metal {

void GatedDeltaRule::eval_gpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  using metal::require;
  for (const mx::array& x : inputs) {
    require(x.flags().row_contiguous, "gated_delta_rule", "every input must be contiguous");
  }
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  const metal_args::GatedDeltaParams p = gated_delta_rule_metal_args(inputs);
  if (p.num_seqs == 0 || outputs[1].size() == 0) return;

  const GatedDeltaLaunch launch = select_gated_delta_rule_kernel(
      metal::dtype_tag(inputs[0].dtype()), p.num_v_heads, p.key_dim, p.value_dim, p.num_seqs);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(inputs[0], GDR_BUF_Q);
  enc.set_input_array(inputs[1], GDR_BUF_K);
  enc.set_input_array(inputs[2], GDR_BUF_V);
  enc.set_input_array(inputs[3], GDR_BUF_G);
  enc.set_input_array(inputs[4], GDR_BUF_BETA);
  enc.set_input_array(inputs[5], GDR_BUF_STATE);
  enc.set_input_array(inputs[6], GDR_BUF_CU_SEQLENS);
  // With no tokens the kernel only copies the states; y is empty and never written, so the state
  // output stands in for its binding.
  enc.set_output_array(outputs[0].size() ? outputs[0] : outputs[1], GDR_BUF_OUT);
  enc.set_output_array(outputs[1], GDR_BUF_STATE_OUT);
  enc.set_bytes(p, GDR_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
