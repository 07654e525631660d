// Helpers shared by the paged-attention kernel families: KV addressing, masking, logit transform.
//
// MSL features used here: metal::tanh, metal::exp, metal::max/min, `constant` struct references,
// `device` pointers, vec<T, 4> loads, static_cast between half / bfloat / float.
#pragma once

#include <metal_stdlib>

#include "constants.h"
#include "ops/attention/params.h"

using namespace metal;

#define PA_NEG_INF (-INFINITY)

// Element offset of key position `pos` of a sequence (kv head applied by the caller), or -1 when
// the block table entry is out of range (the key then reads as zeros).
inline long_t pa_token_offset(
    const device int* block_table,  // this sequence's row of block_tables
    int pos,
    constant PagedAttentionParams& p) {
  const int block = block_table[pos / p.block_size];
  if (block < 0 || block >= p.num_blocks) {
    return -1;
  }
  return long_t(block) * p.kv_stride_block + long_t(pos % p.block_size) * p.kv_stride_slot;
}

// Scaled logit with the optional softcap c * tanh(x / c).
inline float pa_logit(float dot, constant PagedAttentionParams& p) {
  float x = dot * p.scale;
  if (p.softcap > 0.0f) {
    x = p.softcap * metal::tanh(x / p.softcap);
  }
  return x;
}

// First key position attended by query position q_pos (inclusive).
inline int pa_window_start(int q_pos, constant PagedAttentionParams& p) {
  return p.sliding_window > 0 ? metal::max(0, q_pos - p.sliding_window + 1) : 0;
}

// Row of the partial buffers for query head h: kv heads keep `scratch_heads / num_kv_heads` rows
// each, so a GQA threadgroup can store a padded group of 8 heads with one stride.
inline int pa_scratch_row(int h, constant PagedAttentionParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows_per_kv = p.scratch_heads / p.num_kv_heads;
  return (h / group) * rows_per_kv + (h % group);
}
