// The CPU causal_conv1d driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

// Every array contiguous and of `dtype`: x [T, C], weight [C, K], conv_state [S, K - 1, C],
// bias [C] or null (no bias); cu_seqlens [S + 1]. Writes out [T, C] and state_out [S, K - 1, C].
struct ShortConvArgs {
  const void* x;
  const void* weight;
  const void* conv_state;
  const int32_t* cu_seqlens;
  const void* bias;
  void* out;
  void* state_out;
  ElemType dtype;
  int64_t num_tokens, num_seqs, channels, width;
};

// Runs the convolution (float32 sums starting from the bias, SiLU) and writes the new windows, on
// the calling thread or (large calls) the pool. Sequence bounds are clamped to [0, T], so any
// cu_seqlens is memory-safe; rows of out that no sequence covers are zero.
void causal_conv1d(const ShortConvArgs& args);

}  // namespace vllm_metal::cpu
