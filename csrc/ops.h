// The native ops of vllm_metal as MLX primitives: paged KV-cache writes and paged attention.
//
// This header is the contract between the op builders and CPU bodies (csrc/*.cpp) and the Metal
// bodies (csrc/metal/*.cpp, macOS only). Keep it stable: the Metal side reads the members below.
//
// Shared conventions
//   T        packed query/key tokens of the step       Hq / Hkv  query / KV heads (Hq % Hkv == 0)
//   D        head size (identical for K, V and Q)      S         sequences in the batch
//   KV pools are [num_blocks, block_size, Hkv, D]; slot = block_id * block_size + offset.
//   Floating inputs share one dtype: float16, bfloat16 or float32. Math is done in float32.
//   Index inputs are int32 except slot_mapping (int64).
//   Inputs may be strided views (check flags()/strides()); the CPU bodies accept any layout of the
//   query/key/value, and read pools in place when their last two axes are packed (a slice of a
//   larger allocation is fine); other pool layouts are copied first.
//
// ReshapeAndCache — inputs, in order:
//   0 key [T, Hkv, D]   1 value [T, Hkv, D]
//   2 key_cache [NB, BS, Hkv, D]   3 value_cache [NB, BS, Hkv, D]   4 slot_mapping [T] int64
//   Outputs: 0 key_cache', 1 value_cache' with the shapes/dtypes of inputs 2 and 3. The outputs
//   alias the input pools (out.copy_shared_buffer(in), no copy) whenever the pool layout maps each
//   element to its own memory (see pool_is_aliasable); only a broadcast/overlapping pool is copied
//   first. Row t is written to slot slot_mapping[t]; a slot < 0 (padding) or >= NB * BS is skipped.
//   No members.
//
// PagedAttention — inputs, in order:
//   0 query [T, Hq, D]   1 key_cache [NB, BS, Hkv, D]   2 value_cache [NB, BS, Hkv, D]
//   3 block_tables [S, max_blocks] int32   4 seq_lens [S] int32   5 cu_seqlens_q [S + 1] int32
//   6 sinks [Hq] float32 — present only when has_sinks is true.
//   Output: 0 out [T, Hq, D], dtype of query.
//   Query row i of sequence s (token cu_seqlens_q[s] + i) sits at position
//   p = seq_lens[s] - (cu_seqlens_q[s+1] - cu_seqlens_q[s]) + i and attends to key positions
//   max(0, p - sliding_window + 1) .. p (all of 0 .. p when sliding_window == 0). Key position k of
//   sequence s lives at block block_tables[s][k / BS], offset k % BS. Query head h reads KV head
//   h / (Hq / Hkv).
//   Members:
//     scale           multiplies q·k
//     sliding_window  W > 0 limits each query to its last W keys; 0 = unlimited
//     softcap         c > 0 maps each scaled logit x to c * tanh(x / c); 0 = off
//     has_sinks       input 6 holds one extra logit per query head that joins the softmax
//                     denominator only (its value vector is zero)
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace vllm_metal {

namespace mx = mlx::core;

class ReshapeAndCache : public mx::Primitive {
 public:
  explicit ReshapeAndCache(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "ReshapeAndCache"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape(), inputs[3].shape()};
  }
};

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int sliding_window, float softcap, bool has_sinks)
      : mx::UnaryPrimitive(stream),
        scale(scale),
        sliding_window(sliding_window),
        softcap(softcap),
        has_sinks(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttention&>(other);
    return scale == o.scale && sliding_window == o.sliding_window && softcap == o.softcap &&
           has_sinks == o.has_sinks;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

  const float scale;
  const int sliding_window;  // 0 = no window
  const float softcap;       // 0 = no softcap
  const bool has_sinks;
};

// True when writing through `pool`'s strides touches each element's own memory (row-major order
// with possible gaps, as for a contiguous pool or a slice of a larger one), so writes may alias it.
bool pool_is_aliasable(const mx::array& pool);

// Op builders (validate shapes/dtypes, throw std::invalid_argument naming the argument).
std::pair<mx::array, mx::array> reshape_and_cache(
    const mx::array& key, const mx::array& value, const mx::array& key_cache,
    const mx::array& value_cache, const mx::array& slot_mapping, mx::StreamOrDevice s = {});

mx::array paged_attention(
    const mx::array& query, const mx::array& key_cache, const mx::array& value_cache,
    const mx::array& block_tables, const mx::array& seq_lens, const mx::array& cu_seqlens_q,
    float scale, std::optional<int> sliding_window = std::nullopt,
    std::optional<float> softcap = std::nullopt, std::optional<mx::array> sinks = std::nullopt,
    mx::StreamOrDevice s = {});

}  // namespace vllm_metal
