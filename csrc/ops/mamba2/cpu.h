// The CPU mamba2_scan driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

// Every array contiguous. x [T, H, P] and B/C [T, G, N] of `dtype`; dt [T, H], A/D [H] and state
// [S, H, P, N] float32; cu_seqlens [S + 1]. Writes out [T, H, P] (`dtype`) and state_out.
struct Mamba2Args {
  const void* x;
  const float* dt;
  const float* A;
  const void* B;
  const void* C;
  const float* D;
  const float* state;
  const int32_t* cu_seqlens;
  void* out;
  float* state_out;
  ElemType dtype;
  int64_t num_tokens, num_seqs, num_heads, num_groups, head_dim, state_dim;
};

// Runs the recurrence per (sequence, head), on the calling thread or (large calls) the pool.
// Sequence bounds are clamped to [0, T], so any cu_seqlens is memory-safe; rows of out that no
// sequence covers are zero.
void mamba2_scan(const Mamba2Args& args);

}  // namespace vllm_metal::cpu
