// The TurboQuant KV ops as MLX primitives: the paged cache write and the paged attention that reads
// every key and value from the cache (decode rows, short continuation and verification chunks).
// eval_cpu runs the framework-neutral drivers (cpu.h), eval_gpu the Metal kernels (metal.cpp).
//
// What the ops compute is stated at the public entry point (vllm_metal/ops/turboquant/), the bytes
// in common/turboquant.h; arguments are validated there, so the builders assume consistent shapes.
//
// turboquant_write inputs: 0 key [T, H, D] float32 (raw keys for fp8 keys, the Hadamard-rotated
//   unit keys for MSE keys)  1 key_norm [T, H] float32 (|k|; any values for fp8 keys)
//   2 value [T, H, D] float32  3 key_cache [NB, BS, H, key_bytes] uint8  4 value_cache
//   [NB, BS, H, value_bytes] uint8  5 slot_mapping [T] int64  6 centroids [2^key_bits] float32.
//   Outputs: the pools, aliasing inputs 3 and 4 where they can (as ops/cache's write).
// turboquant_attention inputs: 0 query [T, Hq, D] float32 (rotated into the keys' space)
//   1 key_cache  2 value_cache  3 block_tables [S, max_blocks] int32  4 seq_lens [S] int32
//   5 cu_seqlens_q [S + 1] int32  6 centroids  7 sinks [Hq] float32 (has_sinks only).
//   Output: [T, Hq, D] float32.
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/turboquant/cpu.h"
#include "ops/turboquant/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class TurboQuantWrite : public mx::Primitive {
 public:
  TurboQuantWrite(mx::Stream stream, cpu::TqFormat format)
      : mx::Primitive(stream), format(format) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "TurboQuantWrite"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TurboQuantWrite&>(other);
    return format.key_bits == o.format.key_bits && format.value_bits == o.format.value_bits;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[3].shape(), inputs[4].shape()};
  }

  const cpu::TqFormat format;
};

class TurboQuantAttention : public mx::UnaryPrimitive {
 public:
  TurboQuantAttention(mx::Stream stream, cpu::TqFormat format, float scale, int sliding_window,
                      float softcap, bool has_sinks)
      : mx::UnaryPrimitive(stream),
        format(format),
        scale(scale),
        sliding_window(sliding_window),
        softcap(softcap),
        has_sinks(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "TurboQuantAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TurboQuantAttention&>(other);
    return format.key_bits == o.format.key_bits && format.value_bits == o.format.value_bits &&
           format.norm_correction == o.format.norm_correction && scale == o.scale &&
           sliding_window == o.sliding_window && softcap == o.softcap && has_sinks == o.has_sinks;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const cpu::TqFormat format;
  const float scale;
  const int sliding_window;  // 0 = none
  const float softcap;       // 0 = none
  const bool has_sinks;
};

std::pair<mx::array, mx::array> turboquant_write(
    const mx::array& key, const mx::array& key_norm, const mx::array& value,
    const mx::array& key_cache, const mx::array& value_cache, const mx::array& slot_mapping,
    const mx::array& centroids, int key_bits, int value_bits, mx::StreamOrDevice s = {});

mx::array turboquant_attention(const mx::array& query, const mx::array& key_cache,
                               const mx::array& value_cache, const mx::array& block_tables,
                               const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                               const mx::array& centroids, int key_bits, int value_bits,
                               bool norm_correction, float scale,
                               std::optional<int> sliding_window = std::nullopt,
                               std::optional<float> softcap = std::nullopt,
                               std::optional<mx::array> sinks = std::nullopt,
                               mx::StreamOrDevice s = {});

// The Metal kernels' arguments (the split-KV fields from the plan). Host code, built everywhere.
metal_args::TurboQuantWriteParams turboquant_write_metal_args(const TurboQuantWrite& op,
                                                              const std::vector<mx::array>& inputs);
metal_args::TurboQuantAttentionParams turboquant_attention_metal_args(
    const TurboQuantAttention& op, const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
