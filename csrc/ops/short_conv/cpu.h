// The CPU causal_conv1d driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

// Every array of `dtype`: x [T, C] and out [T, C] contiguous, weight [C, K] contiguous, bias [C]
// or null (no bias); cu_seqlens [S + 1]. Sequence s's window (its K - 1 inputs before its first
// token, oldest first; rows of C contiguous elements) is window w(s) of conv_state, and its new
// window is written to window w(s) of state_out, where w(s) = state_indices[s] (s when null) and
// window w starts w * state_stride (state_out_stride) elements in (0: (K - 1) * C, packed
// [S, K - 1, C]). state_out may be conv_state itself (in place) when the w(s) are distinct.
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
  const int32_t* state_indices = nullptr;
  // has_state[s] == 0: sequence s starts from a zero window (its window is not read). Null: every
  // sequence has one.
  const uint8_t* has_state = nullptr;
  int64_t state_stride = 0;
  int64_t state_out_stride = 0;
  bool silu = true;  // SiLU of the sums (false: the sums themselves)
};

// Runs the convolution (float32 sums starting from the bias, then SiLU unless `silu` is false) and
// then writes the new windows, on the calling thread or (large calls) the pool. Sequence bounds are
// clamped to [0, T], so any cu_seqlens is memory-safe; rows of out that no sequence covers are
// zero. Window indices are not checked here.
void causal_conv1d(const ShortConvArgs& args);

}  // namespace vllm_metal::cpu
