// causal_conv1d as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes one Metal kernel.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/short_conv/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Primitive inputs, in order (one float dtype): 0 x [T, C]  1 weight [C, K]
//   2 conv_state [S, K - 1, C]  3 cu_seqlens [S + 1] int32  (4 bias [C], only when given).
// Outputs: 0 y [T, C], 1 the new windows [S, K - 1, C], both of the inputs' dtype (new buffers).
// The builder casts mixed dtypes to float32 (exactly) and the outputs back to the dtypes of x
// and conv_state.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/short_conv/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class CausalConv1d : public mx::Primitive {
 public:
  explicit CausalConv1d(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "CausalConv1d"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[2].shape()};
  }
};

std::pair<mx::array, mx::array> causal_conv1d(const mx::array& x, const mx::array& weight,
                                              const mx::array& conv_state,
                                              const mx::array& cu_seqlens,
                                              const std::optional<mx::array>& bias,
                                              mx::StreamOrDevice s = {});

// The Metal kernel's arguments for a call with these inputs. Host code, built on every platform
// so it is compiled off-Mac too.
metal_args::CausalConv1dParams causal_conv1d_metal_args(const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
