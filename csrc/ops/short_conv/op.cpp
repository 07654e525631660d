// causal_conv1d: the op builder and eval_cpu, which stages the inputs contiguously and hands plain
// pointers to the driver.

#include "ops/short_conv/op.h"

#include <memory>

#include "common/array_utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/short_conv/cpu.h"

namespace vllm_metal {

std::pair<mx::array, mx::array> causal_conv1d(const mx::array& x, const mx::array& weight,
                                              const mx::array& conv_state,
                                              const mx::array& cu_seqlens,
                                              const std::optional<mx::array>& bias,
                                              mx::StreamOrDevice s) {
  // One kernel dtype: the common one, else float32 (widening is exact, and the new windows hold
  // only inputs, so narrowing them back to conv_state's dtype matches the contract).
  const bool same = x.dtype() == weight.dtype() && x.dtype() == conv_state.dtype() &&
                    (!bias || bias->dtype() == x.dtype());
  const mx::Dtype dt = same ? x.dtype() : mx::float32;
  std::vector<mx::array> inputs = {mx::astype(x, dt, s), mx::astype(weight, dt, s),
                                   mx::astype(conv_state, dt, s), cu_seqlens};
  if (bias) inputs.push_back(mx::astype(*bias, dt, s));
  auto outputs = mx::array::make_arrays({x.shape(), conv_state.shape()}, {dt, dt},
                                        std::make_shared<CausalConv1d>(mx::to_stream(s)),
                                        std::move(inputs));
  if (same) return {outputs[0], outputs[1]};
  return {mx::astype(outputs[0], x.dtype(), s), mx::astype(outputs[1], conv_state.dtype(), s)};
}

metal_args::CausalConv1dParams causal_conv1d_metal_args(const std::vector<mx::array>& inputs) {
  return {
      .num_tokens = inputs[0].shape(0),
      .num_seqs = inputs[2].shape(0),
      .channels = inputs[0].shape(1),
      .width = inputs[1].shape(1),
      .has_bias = inputs.size() > 4 ? 1 : 0,
  };
}

void CausalConv1d::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const std::vector<mx::array> in = cpu::stage_io(inputs, outputs, encoder);

  const cpu::ShortConvArgs a{
      .x = in[0].data<void>(),
      .weight = in[1].data<void>(),
      .conv_state = in[2].data<void>(),
      .cu_seqlens = in[3].data<int32_t>(),
      .bias = in.size() > 4 ? in[4].data<void>() : nullptr,
      .out = outputs[0].data<void>(),
      .state_out = outputs[1].data<void>(),
      .dtype = cpu::elem_type(in[0].dtype()),
      .num_tokens = in[0].shape(0),
      .num_seqs = in[2].shape(0),
      .channels = in[0].shape(1),
      .width = in[1].shape(1),
  };
  encoder.dispatch([a]() { cpu::causal_conv1d(a); });
}

}  // namespace vllm_metal
