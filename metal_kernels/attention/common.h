// Helpers shared by the paged-attention kernel families: KV addressing, masking, logit transform.
//
// MSL features used here: metal::tanh, metal::exp, metal::max/min, `constant` struct references,
// `device` pointers, `threadgroup` pointers and `thread` references as function parameters,
// simd_shuffle_xor, vec<T, 4> loads, static_cast between half / bfloat / float. Compiled with
// -I csrc (constants.h, ops/attention/params.h).
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

// One online-softmax step over a tile of KB scores for a row held by LANES lanes of a simdgroup
// (4 or 8; lane `col0` of the row owns columns col0, col0 + LANES, ...). Tile column c is key
// position b0 + c; keys outside [lo, hi) are masked. Folds the tile into the running (m_run, l_run),
// stores the probabilities as T in p_row and returns the factor that rescales the row's output.
template <typename T, int KB, int LANES>
inline float pa_softmax_tile(
    threadgroup const float* s_row, threadgroup T* p_row, int col0, int b0, int lo, int hi,
    constant PagedAttentionParams& p, thread float& m_run, thread float& l_run) {
  float x[KB / LANES];
  float mx = PA_NEG_INF;
  for (int t = 0; t < KB / LANES; ++t) {
    const int col = col0 + LANES * t;
    const int pos = b0 + col;
    x[t] = pos >= lo && pos < hi ? pa_logit(s_row[col], p) : PA_NEG_INF;
    mx = metal::max(mx, x[t]);
  }
  for (ushort m = 1; m < LANES; m *= 2) {
    mx = metal::max(mx, simd_shuffle_xor(mx, m));  // the row's max over its lanes
  }
  const float m_new = metal::max(m_run, mx);
  const float shift = m_new == PA_NEG_INF ? 0.0f : m_new;
  const float f = metal::exp(m_run - shift);
  float ls = 0.0f;
  for (int t = 0; t < KB / LANES; ++t) {
    const float w = metal::exp(x[t] - shift);
    ls += w;
    p_row[col0 + LANES * t] = T(w);
  }
  for (ushort m = 1; m < LANES; m *= 2) {
    ls += simd_shuffle_xor(ls, m);  // the row's sum over its lanes
  }
  l_run = l_run * f + ls;
  m_run = m_new;
  return f;
}

// Row `row` of an 8x8 float matrix diag(v), written by the 4 lanes of that row: lane col0 writes
// columns 2 * col0 and 2 * col0 + 1.
inline void pa_diag_row(threadgroup float* diag, int row, int col0, float v) {
  diag[row * 8 + 2 * col0] = (2 * col0 == row) ? v : 0.0f;
  diag[row * 8 + 2 * col0 + 1] = (2 * col0 + 1 == row) ? v : 0.0f;
}

// Row of the partial buffers for query head h: kv heads keep `scratch_heads / num_kv_heads` rows
// each, so a GQA threadgroup can store a padded group of 8 heads with one stride.
inline int pa_scratch_row(int h, constant PagedAttentionParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows_per_kv = p.scratch_heads / p.num_kv_heads;
  return (h / group) * rows_per_kv + (h % group);
}
