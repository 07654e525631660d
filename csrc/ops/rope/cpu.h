// The CPU rotary_embedding driver: plain pointers and element strides in, so any framework's op
// (the MLX primitive here, the in-place entry on DLPack tensors, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"  // ElemType

namespace vllm_metal::cpu {

// One rotated tensor [T, H, D]: `in` read through (stride_token, stride_head), `out` written
// through (out_stride_token, out_stride_head); the last axis is contiguous in both (stride 1).
//
// In place is supported: `out` may equal `in` with the same strides (each row is read whole
// before any of it is written, and pass-through elements are then left untouched). Otherwise
// `out` must not overlap `in`.
struct RopeTensor {
  const void* in;
  void* out;
  int64_t num_heads;
  int64_t stride_token, stride_head;
  int64_t out_stride_token, out_stride_head;
};

// query and key share `dtype` and the head size; cos_sin_cache rows [max_position, rotary_dim]
// (cosines then sines, each rotary_dim / 2 wide) are `cache_stride` elements apart, of
// `cache_dtype` (float32, or the dtype of query/key), contiguous within a row; positions are
// int32 or int64 (`positions_64`), `positions_stride` elements apart. key.num_heads may be 0 (no
// key: its pointers are then never used).
struct RopeArgs {
  const void* positions;
  bool positions_64;
  int64_t positions_stride;
  const void* cos_sin_cache;
  ElemType cache_dtype;
  int64_t cache_stride;
  int64_t max_position, rotary_dim;
  RopeTensor query, key;
  ElemType dtype;
  int64_t num_tokens, head_size;
  bool is_neox;
};

// out[t, h, :] = the rotation of in[t, h, :rotary_dim] by the cache row of positions[t], then
// in[t, h, rotary_dim:] unchanged; in float32, stored in `dtype`. Neox style rotates the pairs
// (i, i + rotary_dim / 2), GPT-J style the pairs (2i, 2i + 1): x1' = x1 cos - x2 sin,
// x2' = x2 cos + x1 sin. Positions are clamped to [0, max_position - 1], so any value is
// memory-safe (max_position must be >= 1 when num_tokens > 0). Runs on the calling thread or
// (large calls) the pool.
void rotary_embedding(const RopeArgs& args);

}  // namespace vllm_metal::cpu
