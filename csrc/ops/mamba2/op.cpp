// mamba2_scan: the op builder and eval_cpu, which stages the inputs contiguously and hands plain
// pointers to the driver.

#include "ops/mamba2/op.h"

#include <memory>

#include "common/array_utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/mamba2/cpu.h"

namespace vllm_metal {

std::pair<mx::array, mx::array> mamba2_scan(const mx::array& x, const mx::array& dt,
                                            const mx::array& A, const mx::array& B,
                                            const mx::array& C, const mx::array& D,
                                            const mx::array& state, const mx::array& cu_seqlens,
                                            mx::StreamOrDevice s) {
  auto outputs = mx::array::make_arrays({x.shape(), state.shape()}, {x.dtype(), mx::float32},
                                        std::make_shared<Mamba2Scan>(mx::to_stream(s)),
                                        {x, dt, A, B, C, D, state, cu_seqlens});
  return {outputs[0], outputs[1]};
}

metal_args::Mamba2ScanParams mamba2_scan_metal_args(const std::vector<mx::array>& inputs) {
  const mx::array& x = inputs[0];
  const mx::array& B = inputs[3];
  return {
      .num_tokens = x.shape(0),
      .num_seqs = inputs[6].shape(0),
      .num_heads = x.shape(1),
      .num_groups = B.shape(1),
      .head_dim = x.shape(2),
      .state_dim = B.shape(2),
  };
}

void Mamba2Scan::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const std::vector<mx::array> in = cpu::stage_io(inputs, outputs, encoder);

  const cpu::Mamba2Args a{
      .x = in[0].data<void>(),
      .dt = in[1].data<float>(),
      .A = in[2].data<float>(),
      .B = in[3].data<void>(),
      .C = in[4].data<void>(),
      .D = in[5].data<float>(),
      .state = in[6].data<float>(),
      .cu_seqlens = in[7].data<int32_t>(),
      .out = outputs[0].data<void>(),
      .state_out = outputs[1].data<float>(),
      .dtype = cpu::elem_type(in[0].dtype()),
      .num_tokens = in[0].shape(0),
      .num_seqs = in[6].shape(0),
      .num_heads = in[0].shape(1),
      .num_groups = in[3].shape(1),
      .head_dim = in[0].shape(2),
      .state_dim = in[3].shape(2),
  };
  encoder.dispatch([a]() { cpu::mamba2_scan(a); });
}

}  // namespace vllm_metal
