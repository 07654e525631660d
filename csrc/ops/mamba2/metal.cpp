// Mamba2Scan::eval_gpu: one kernel, one simdgroup per (sequence, head, state row).
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/mamba2/op.h"
#include "ops/mamba2/plan.h"

namespace vllm_metal {

void Mamba2Scan::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  using metal::require;
  for (const mx::array& x : inputs) {
    require(x.flags().row_contiguous, "mamba2_scan", "every input must be contiguous");
  }
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  const metal_args::Mamba2ScanParams p = mamba2_scan_metal_args(inputs);
  if (p.num_seqs == 0 || outputs[1].size() == 0) return;

  const Mamba2Launch launch = select_mamba2_scan_kernel(
      metal::dtype_tag(inputs[0].dtype()), p.num_heads, p.head_dim, p.state_dim, p.num_seqs);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, launch.kernel));
  // With no tokens the kernel only copies the states: the empty per-token buffers are never read
  // or written, and the state buffers stand in for their bindings.
  const mx::array& state = inputs[6];
  auto input = [&](int i) -> const mx::array& { return inputs[i].size() ? inputs[i] : state; };
  enc.set_input_array(input(0), M2_BUF_X);
  enc.set_input_array(input(1), M2_BUF_DT);
  enc.set_input_array(inputs[2], M2_BUF_A);
  enc.set_input_array(input(3), M2_BUF_B);
  enc.set_input_array(input(4), M2_BUF_C);
  enc.set_input_array(inputs[5], M2_BUF_D);
  enc.set_input_array(state, M2_BUF_STATE);
  enc.set_input_array(inputs[7], M2_BUF_CU_SEQLENS);
  enc.set_output_array(outputs[0].size() ? outputs[0] : outputs[1], M2_BUF_OUT);
  enc.set_output_array(outputs[1], M2_BUF_STATE_OUT);
  enc.set_bytes(p, M2_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(launch.grid[0], launch.grid[1], launch.grid[2]),
                            MTL::Size(launch.threads, 1, 1));
}

}  // namespace vllm_metal
