// gated_delta_rule as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes one Metal kernel.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/gated_delta/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Inputs, in order: 0 q [T, Hk, Dk]  1 k [T, Hk, Dk]  2 v [T, Hv, Dv] (one float dtype)
//   3 g [T, Hv]  4 beta [T, Hv]  5 state [S, Hv, Dv, Dk] (float32)  6 cu_seqlens [S + 1] int32.
// Outputs: 0 y [T, Hv, Dv] in q's dtype, 1 the new state [S, Hv, Dv, Dk] float32 (new buffers).
#pragma once

#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/gated_delta/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class GatedDeltaRule : public mx::Primitive {
 public:
  explicit GatedDeltaRule(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "GatedDeltaRule"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape(), inputs[5].shape()};
  }
};

std::pair<mx::array, mx::array> gated_delta_rule(const mx::array& q, const mx::array& k,
                                                 const mx::array& v, const mx::array& g,
                                                 const mx::array& beta, const mx::array& state,
                                                 const mx::array& cu_seqlens,
                                                 mx::StreamOrDevice s = {});

// The Metal kernel's arguments for a call with these inputs. Host code, built on every platform
// so it is compiled off-Mac too.
metal_args::GatedDeltaParams gated_delta_rule_metal_args(const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
