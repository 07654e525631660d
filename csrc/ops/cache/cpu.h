// The CPU reshape_and_cache driver: plain pointers and element strides in, so any framework's op
// (the MLX primitive here, a torch custom op) can call it.
#pragma once

#include <cstdint>

#include "common/elem.h"
#include "common/fp8.h"
#include "common/strided.h"

namespace vllm_metal::cpu {

// Rows [T, H, D] (src) scattered into one pool [NB, BS, H, D] (dst) at slots[t].
struct CacheWriteArgs {
  const char* src;
  char* dst;
  const int64_t* slots;  // [T]; a slot < 0 (padding) or >= num_slots is skipped
  int64_t num_tokens, num_heads, head_dim, block_size, num_slots, itemsize;
  int64_t src_stride_t, src_stride_h, src_stride_d;
  int64_t dst_stride_b, dst_stride_o, dst_stride_h, dst_stride_d;
  // fp8 pools: each element x of src (of type src_type) is stored as the byte fp8(x / scale)
  // (common/fp8.h); `itemsize` is then the source's, and the pool holds one byte per element.
  // Per-token-head pools (int8 / fp8 / int4_per_token_head): each row is stored as its element
  // bytes (int4: head_dim / 2, two levels a byte) and its own float32 scale after them
  // (common/per_token_head.h; `scale` unused).
  KvFormat kv_format = KvFormat::same;
  ElemType src_type = ElemType::f32;
  float scale = 1.0f;
};

// The write of rows `src` ([T, H, D], or [T, D] for a headless latent cache) into the pool `dst`
// ([NB, BS, H, D], or [NB, BS, D]) at `slots`, any strides on both sides. Every caller (the MLX
// primitives, the DLPack entry points) builds the driver's arguments here; the shapes must already
// be consistent.
CacheWriteArgs write_args(const Strided& src, const Strided& dst, const int64_t* slots,
                          int64_t itemsize);

// The same write quantized to fp8 bytes of `format` with `scale` (src of element type `type`).
CacheWriteArgs quantized(CacheWriteArgs args, KvFormat format, ElemType type, float scale);

// Writes the key rows and the value rows, on the calling thread or (large writes) the pool.
void reshape_and_cache(const CacheWriteArgs& key, const CacheWriteArgs& value);

// Writes one pool's rows the same way (mla_reshape_and_cache: one latent pool, one "head").
void write_cache(const CacheWriteArgs& rows);

}  // namespace vllm_metal::cpu
