// gated_delta_rule: the op builder and eval_cpu, which stages the inputs contiguously and hands
// plain pointers to the driver.

#include "ops/gated_delta/op.h"

#include <memory>

#include "common/array_utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/gated_delta/cpu.h"

namespace vllm_metal {

std::pair<mx::array, mx::array> gated_delta_rule(const mx::array& q, const mx::array& k,
                                                 const mx::array& v, const mx::array& g,
                                                 const mx::array& beta, const mx::array& state,
                                                 const mx::array& cu_seqlens,
                                                 mx::StreamOrDevice s) {
  auto outputs = mx::array::make_arrays(
      {v.shape(), state.shape()}, {q.dtype(), mx::float32},
      std::make_shared<GatedDeltaRule>(mx::to_stream(s)), {q, k, v, g, beta, state, cu_seqlens});
  return {outputs[0], outputs[1]};
}

metal_args::GatedDeltaParams gated_delta_rule_metal_args(const std::vector<mx::array>& inputs) {
  const mx::array& q = inputs[0];
  const mx::array& v = inputs[2];
  return {
      .num_tokens = q.shape(0),
      .num_seqs = inputs[5].shape(0),
      .num_k_heads = q.shape(1),
      .num_v_heads = v.shape(1),
      .key_dim = q.shape(2),
      .value_dim = v.shape(2),
  };
}

void GatedDeltaRule::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const std::vector<mx::array> in = cpu::stage_io(inputs, outputs, encoder);

  const cpu::GatedDeltaArgs a{
      .q = in[0].data<void>(),
      .k = in[1].data<void>(),
      .v = in[2].data<void>(),
      .g = in[3].data<float>(),
      .beta = in[4].data<float>(),
      .state = in[5].data<float>(),
      .cu_seqlens = in[6].data<int32_t>(),
      .out = outputs[0].data<void>(),
      .state_out = outputs[1].data<float>(),
      .dtype = cpu::elem_type(in[0].dtype()),
      .num_tokens = in[0].shape(0),
      .num_seqs = in[5].shape(0),
      .num_k_heads = in[0].shape(1),
      .num_v_heads = in[2].shape(1),
      .key_dim = in[0].shape(2),
      .value_dim = in[2].shape(2),
  };
  encoder.dispatch([a]() { cpu::gated_delta_rule(a); });
}

}  // namespace vllm_metal
