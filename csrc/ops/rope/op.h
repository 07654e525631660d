// rotary_embedding as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes one Metal kernel.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/rope/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Primitive inputs, in order: 0 positions [T] int32 or int64  1 query [T, Hq, D]  2 key [T, Hkv, D]
//   (query's dtype)  3 cos_sin_cache [max_position, rotary_dim] (float32 or query's dtype).
// query and key are read through their strides (a view of a fused QKV projection is used in
// place). Outputs: 0 query rotated, 1 key rotated, new contiguous buffers of query's dtype.
#pragma once

#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/rope/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class RotaryEmbedding : public mx::Primitive {
 public:
  RotaryEmbedding(mx::Stream stream, bool is_neox) : mx::Primitive(stream), is_neox(is_neox) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "RotaryEmbedding"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return static_cast<const RotaryEmbedding&>(other).is_neox == is_neox;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape(), inputs[2].shape()};
  }

  const bool is_neox;
};

std::pair<mx::array, mx::array> rotary_embedding(const mx::array& positions,
                                                 const mx::array& query, const mx::array& key,
                                                 const mx::array& cos_sin_cache, bool is_neox,
                                                 mx::StreamOrDevice s = {});

// The Metal kernel's arguments for a call with these inputs. Host code, built on every platform
// so it is compiled off-Mac too.
metal_args::RotaryEmbeddingParams rotary_embedding_metal_args(const RotaryEmbedding& op,
                                                              const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
