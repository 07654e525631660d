// CausalConv1d::eval_gpu: one kernel, one thread per (row, channel); rows are the tokens, then
// the sequences' new-window entries.
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/short_conv/op.h"
#include "ops/short_conv/plan.h"

namespace vllm_metal {

void CausalConv1d::eval_gpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  using metal::require;
  for (const mx::array& x : inputs) {
    require(x.flags().row_contiguous, "causal_conv1d", "every input must be contiguous");
  }
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  const metal_args::CausalConv1dParams p = causal_conv1d_metal_args(inputs);
  if (p.channels == 0 || (outputs[0].size() == 0 && outputs[1].size() == 0)) return;

  const ShortConvLaunch launch = select_causal_conv1d_kernel(
      metal::dtype_tag(inputs[0].dtype()), p.num_tokens, p.num_seqs, p.channels, p.width);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  enc.set_input_array(inputs[0].size() ? inputs[0] : inputs[1], SC_BUF_X);
  enc.set_input_array(inputs[1], SC_BUF_WEIGHT);
  enc.set_input_array(inputs[2].size() ? inputs[2] : inputs[1], SC_BUF_CONV_STATE);
  enc.set_input_array(inputs[3], SC_BUF_CU_SEQLENS);
  // An empty buffer (no tokens, or no sequences) and an absent bias are never read or written;
  // another stands in for its binding.
  enc.set_input_array(p.has_bias ? inputs[4] : inputs[1], SC_BUF_BIAS);
  enc.set_output_array(outputs[0].size() ? outputs[0] : outputs[1], SC_BUF_OUT);
  enc.set_output_array(outputs[1].size() ? outputs[1] : outputs[0], SC_BUF_STATE_OUT);
  enc.set_bytes(p, SC_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
