// The CPU paged-attention driver: plain pointers and shapes in, so any framework's op (the MLX
// primitive here, a torch custom op) can call it. It partitions the batch into work items, splits
// long key ranges across threads (merging their partial softmax states), and runs the inner kernel
// build chosen for this CPU (cpu_isa.h) on the shared thread pool.
//
// Only plain data here (and common/elem.h, common/fp8.h and common/strided.h, built for that):
// the ISA-specific kernel objects include this header.
#pragma once

#include <cstdint>

#include "common/elem.h"     // ElemType
#include "common/fp8.h"      // KvFormat
#include "common/strided.h"  // Strided

namespace vllm_metal::cpu {

// KvFormat (common/fp8.h): fp8 pools read a key as value(byte) * k_scale, a value as
// value(byte) * v_scale (vllm_metal/ops/fp8.py); per-token-head pools read an element as
// value(byte) * its row's scale (common/per_token_head.h, vllm_metal/ops/per_token_head.py).

struct AttentionArgs {
  const void* query;            // [T, Hq, D], element strides q_stride_*
  const void* key_cache;        // [NB, BS, Hkv, kv_row]: strides kc_stride_b/o; heads packed
  const void* value_cache;      // same shape as key_cache, strides vc_stride_b/o
  const int32_t* block_tables;  // [S, max_blocks] contiguous
  const int32_t* seq_lens;      // [S]
  const int32_t* cu_seqlens_q;  // [S + 1]
  const float* sinks;           // [Hq] or nullptr
  void* out;                    // [T, Hq, D] contiguous
  ElemType dtype;
  int64_t num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim;
  int64_t num_blocks, block_size, max_blocks;
  int64_t q_stride_t, q_stride_h, q_stride_d;
  int64_t kc_stride_b, kc_stride_o;
  int64_t vc_stride_b, vc_stride_o;
  float scale;
  int32_t sliding_window;  // 0 = none
  float softcap;           // 0 = none
  int64_t kv_row;          // pool elements per (key, KV head) row: D, or a per-token-head row's bytes
  KvFormat kv_format = KvFormat::same;
  float k_scale = 1.0f, v_scale = 1.0f;  // fp8 pools only
};

// The arguments for arrays described by their views: query [T, Hq, D] (any strides), the pools
// [NB, BS, Hkv, kv_row] (rows_packed: any block and slot strides), block_tables [S, max_blocks]
// (contiguous); the other arrays are contiguous. Every caller (the MLX primitive, the DLPack entry
// points) builds the driver's arguments here; the shapes must already be consistent.
AttentionArgs attention_args(const Strided& query, const Strided& key_cache,
                             const Strided& value_cache, const Strided& block_tables,
                             const int32_t* seq_lens, const int32_t* cu_seqlens_q,
                             const float* sinks, void* out, ElemType dtype, float scale,
                             int32_t sliding_window, float softcap);

// Computes `out` on the calling thread and the pool, with the kernel build `isa` (cpu_isa.h).
// Index values are clamped, so any values are memory-safe; tokens outside every sequence get zeros.
void paged_attention(const AttentionArgs& args, int isa);

}  // namespace vllm_metal::cpu
