// The MLA ops as MLX primitives: mla_attention (eval_cpu runs the framework-neutral CPU driver,
// cpu.h; eval_gpu encodes one Metal kernel) and mla_reshape_and_cache (the latent-cache write,
// sharing reshape_and_cache's CPU driver and pool aliasing, ops/cache/).
//
// What the ops compute is stated once, at the public entry point (vllm_metal/ops/mla/); arguments
// are validated there too, so the builders assume consistent shapes and dtypes.
//
// mla_attention inputs, in order: 0 query [T, H, D]  1 latent_cache [NB, BS, D]
//   2 block_tables [S, max_blocks] int32  3 seq_lens [S] int32  4 cu_seqlens_q [S + 1] int32.
// Output: [T, H, value_dim] in the query's dtype (a new buffer).
//
// mla_reshape_and_cache inputs: 0 latent [T, D]  1 latent_cache [NB, BS, D]  2 slot_mapping [T]
// int64. Output: latent_cache', aliasing the input pool whenever it is aliasable
// (pool_is_aliasable), else a written copy.
#pragma once

#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/mla/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class MlaAttention : public mx::UnaryPrimitive {
 public:
  MlaAttention(mx::Stream stream, float scale, int value_dim)
      : mx::UnaryPrimitive(stream), scale(scale), value_dim(value_dim) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "MlaAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const MlaAttention&>(other);
    return scale == o.scale && value_dim == o.value_dim;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1), value_dim}};
  }

  const float scale;    // multiplies q . row
  const int value_dim;  // the value is a row's first value_dim columns
};

class MlaReshapeAndCache : public mx::UnaryPrimitive {
 public:
  explicit MlaReshapeAndCache(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "MlaReshapeAndCache"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }
};

mx::array mla_attention(const mx::array& query, const mx::array& latent_cache,
                        const mx::array& block_tables, const mx::array& seq_lens,
                        const mx::array& cu_seqlens_q, float scale, int value_dim,
                        mx::StreamOrDevice s = {});

mx::array mla_reshape_and_cache(const mx::array& latent, const mx::array& latent_cache,
                                const mx::array& slot_mapping, mx::StreamOrDevice s = {});

// The Metal kernels' arguments for calls with these inputs. Host code, built on every platform so
// it is compiled off-Mac too.
metal_args::MlaAttentionParams mla_attention_metal_args(const MlaAttention& op,
                                                        const std::vector<mx::array>& inputs);
metal_args::MlaReshapeAndCacheParams mla_reshape_and_cache_metal_args(
    const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
