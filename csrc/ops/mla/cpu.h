// The CPU mla_attention driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

struct MlaAttentionArgs {
  const void* query;            // [T, H, D] contiguous
  const void* latent_cache;     // [NB, BS, D]: block stride cache_stride_b, rows D apart
  const int32_t* block_tables;  // [S, max_blocks] contiguous
  const int32_t* seq_lens;      // [S]
  const int32_t* cu_seqlens_q;  // [S + 1]
  void* out;                    // [T, H, DV] contiguous
  ElemType dtype;
  int64_t num_tokens, num_seqs, num_heads, latent_dim, value_dim;
  int64_t num_blocks, block_size, max_blocks;
  int64_t cache_stride_b;
  float scale;
};

// Computes `out` per (token, group of heads) on the calling thread or the pool. Each latent row a
// token attends is widened to float32 once and serves every head of the group (all heads unless
// the batch has fewer tokens than threads). Index values are clamped, so any values are
// memory-safe: a block id outside the pool reads as a zero row, and tokens outside every sequence
// get zeros.
void mla_attention(const MlaAttentionArgs& args);

}  // namespace vllm_metal::cpu
