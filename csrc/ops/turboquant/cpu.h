// The CPU drivers of the TurboQuant KV ops: plain pointers and shapes in (common/turboquant.h
// states the bytes), so any framework's op can call them.
#pragma once

#include <cstdint>

namespace vllm_metal::cpu {

// The bits of a TurboQuant format: keys 8 (fp8) or 3 / 4 (MSE indices and a norm), values 3 / 4.
struct TqFormat {
  int key_bits = 8;
  int value_bits = 4;
  bool norm_correction = false;
};

// A pool of TurboQuant rows [NB, BS, H, row_bytes]: byte strides of its block, slot and head axes
// (the row's bytes contiguous).
struct TqPool {
  uint8_t* data = nullptr;
  int64_t stride_block = 0, stride_slot = 0, stride_head = 0;
};

// Rows [T, H, D] quantized into the pools at slots[t] (a slot < 0 or >= num_slots is skipped).
struct TqWriteArgs {
  const float* key;        // [T, H, D] contiguous: raw keys (fp8) or rotated unit keys (MSE)
  const float* key_norm;   // [T, H] contiguous: |k| of MSE keys (unused for fp8 keys)
  const float* value;      // [T, H, D] contiguous
  const float* centroids;  // [2^key_bits] ascending (MSE keys)
  TqPool key_cache, value_cache;
  const int64_t* slots;  // [T]
  int64_t num_tokens, num_heads, head_dim, block_size, num_slots;
  TqFormat format;
};

// Paged attention of query rows [T, Hq, D] (rotated into the keys' scoring space) over the pools,
// every key read from the cache (the varlen contract of vllm_metal.ops.paged_attention).
struct TqAttentionArgs {
  const float* query;  // [T, Hq, D] contiguous
  TqPool key_cache, value_cache;
  const int32_t* block_tables;  // [S, max_blocks] contiguous
  const int32_t* seq_lens;      // [S]
  const int32_t* cu_seqlens_q;  // [S + 1]
  const float* sinks;           // [Hq] or nullptr
  const float* centroids;       // [2^key_bits] (MSE keys)
  float* out;                   // [T, Hq, D] contiguous
  int64_t num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim;
  int64_t num_blocks, block_size, max_blocks;
  float scale;
  int32_t sliding_window;  // 0 = none
  float softcap;           // 0 = none
  TqFormat format;
};

// Writes the rows, on the calling thread or (large writes) the pool.
void turboquant_write(const TqWriteArgs& args);

// Computes `out` on the calling thread and the pool. Block ids outside [0, num_blocks) read as
// zero keys and values; tokens outside every sequence get zeros.
void turboquant_attention(const TqAttentionArgs& args);

}  // namespace vllm_metal::cpu
