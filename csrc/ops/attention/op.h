// paged_attention as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes the planned Metal kernels.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/attention/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Inputs, in order: 0 query [T, Hq, D]  1 key_cache [NB, BS, Hkv, D]  2 value_cache (same)
//   3 block_tables [S, max_blocks] int32  4 seq_lens [S] int32  5 cu_seqlens_q [S + 1] int32
//   6 sinks [Hq] float32, present only when has_sinks.
// Output: [T, Hq, D] in the query's dtype. Pools hold the query's dtype, or (kv_format fp8_e4m3 /
// fp8_e5m2) uint8 fp8 bytes read as value * k_scale / v_scale, by the CPU body and by the _fp8
// instances of every Metal kernel family.
// Inputs may be strided views: the CPU body reads any layout of the query and reads pools in place
// when their last two axes are packed (a slice of a larger allocation is fine), copying others.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/attention/cpu.h"
#include "ops/attention/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int sliding_window, float softcap, bool has_sinks,
                 cpu::KvFormat kv_format = cpu::KvFormat::same, float k_scale = 1.0f,
                 float v_scale = 1.0f)
      : mx::UnaryPrimitive(stream),
        scale(scale),
        sliding_window(sliding_window),
        softcap(softcap),
        has_sinks(has_sinks),
        kv_format(kv_format),
        k_scale(k_scale),
        v_scale(v_scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttention&>(other);
    return scale == o.scale && sliding_window == o.sliding_window && softcap == o.softcap &&
           has_sinks == o.has_sinks && kv_format == o.kv_format && k_scale == o.k_scale &&
           v_scale == o.v_scale;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const float scale;         // multiplies q.k
  const int sliding_window;  // 0 = no window
  const float softcap;       // 0 = no softcap
  const bool has_sinks;      // input 6 holds one extra logit per query head
  const cpu::KvFormat kv_format;  // same: pools in the query's dtype; else fp8 bytes (uint8)
  const float k_scale, v_scale;   // fp8 pools: what one stored unit of K / V is worth
};

mx::array paged_attention(
    const mx::array& query, const mx::array& key_cache, const mx::array& value_cache,
    const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
    float scale, std::optional<int> sliding_window = std::nullopt,
    std::optional<float> softcap = std::nullopt, std::optional<mx::array> sinks = std::nullopt,
    const std::string& kv_cache_dtype = "auto", float k_scale = 1.0f, float v_scale = 1.0f,
    mx::StreamOrDevice s = {});

// The Metal kernels' arguments for a call with these inputs, except the fields of one launch
// (num_work, partition_size, scratch_heads) that the encoder takes from its plan. Host code, built
// on every platform so it is compiled off-Mac too.
metal_args::PagedAttentionParams paged_attention_metal_args(const PagedAttention& op,
                                                            const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
