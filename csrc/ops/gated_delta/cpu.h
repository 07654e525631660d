// The CPU gated_delta_rule driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

// Every array contiguous. q/k [T, Hk, Dk] and v [T, Hv, Dv] of `dtype`; g, beta [T, Hv], state
// [S, Hv, Dv, Dk] float32; cu_seqlens [S + 1]. Writes out [T, Hv, Dv] (`dtype`) and state_out.
struct GatedDeltaArgs {
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const float* state;
  const int32_t* cu_seqlens;
  void* out;
  float* state_out;
  ElemType dtype;
  int64_t num_tokens, num_seqs, num_k_heads, num_v_heads, key_dim, value_dim;
};

// Runs the recurrence per (sequence, value head), on the calling thread or (large calls) the pool.
// Sequence bounds are clamped to [0, T], so any cu_seqlens is memory-safe; rows of out that no
// sequence covers are zero.
void gated_delta_rule(const GatedDeltaArgs& args);

}  // namespace vllm_metal::cpu
