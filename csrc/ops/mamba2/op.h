// mamba2_scan as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes one Metal kernel.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/mamba2/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Inputs, in order: 0 x [T, H, P]  1 dt [T, H] (float32)  2 A [H] (float32)  3 B [T, G, N]
//   4 C [T, G, N] (x, B and C of one float dtype)  5 D [H] (float32)  6 state [S, H, P, N]
//   (float32)  7 cu_seqlens [S + 1] int32.
// Outputs: 0 y [T, H, P] in x's dtype, 1 the new state [S, H, P, N] float32 (new buffers).
#pragma once

#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/mamba2/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class Mamba2Scan : public mx::Primitive {
 public:
  explicit Mamba2Scan(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "Mamba2Scan"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[6].shape()};
  }
};

std::pair<mx::array, mx::array> mamba2_scan(const mx::array& x, const mx::array& dt,
                                            const mx::array& A, const mx::array& B,
                                            const mx::array& C, const mx::array& D,
                                            const mx::array& state, const mx::array& cu_seqlens,
                                            mx::StreamOrDevice s = {});

// The Metal kernel's arguments for a call with these inputs. Host code, built on every platform
// so it is compiled off-Mac too.
metal_args::Mamba2ScanParams mamba2_scan_metal_args(const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
