// Kernel argument structs shared by the Metal sources and the host that encodes them.
//
// Plain scalars only (int = 32-bit, long = 64-bit, float), so the layout is identical in MSL and in
// the C++ host (csrc/metal/, included there with VLLM_METAL_HOST defined). Passed with set_bytes.
#pragma once

#ifdef VLLM_METAL_HOST
#include <cstdint>
namespace vllm_metal::metal_args {
using long_t = int64_t;
#else
typedef long long_t;
#endif

// Buffer indices, the same for every attention family (unused ones get any bound buffer).
#define PA_BUF_QUERY 0
#define PA_BUF_KEY_CACHE 1
#define PA_BUF_VALUE_CACHE 2
#define PA_BUF_BLOCK_TABLES 3
#define PA_BUF_SEQ_LENS 4
#define PA_BUF_CU_SEQLENS_Q 5
#define PA_BUF_SINKS 6
#define PA_BUF_OUT 7
#define PA_BUF_WORK 8
#define PA_BUF_PART_OFFSETS 9
#define PA_BUF_PARTIAL_ML 10
#define PA_BUF_PARTIAL_OUT 11
#define PA_BUF_PARAMS 12

// Tokens per split-KV partition (a multiple of every kernel block). Partitions of a decode row
// start at its first attended key rounded down to a multiple of 32.
#define PA_PARTITION_ALIGN 32

struct PagedAttentionParams {
  int num_seqs;
  int num_q_heads;
  int num_kv_heads;
  int num_blocks;          // block ids outside [0, num_blocks) read as zero keys/values
  int block_size;          // vLLM block size (a multiple of the kernel block)
  int max_blocks_per_seq;  // row stride of block_tables
  long_t q_stride_token;   // query element strides; the head_dim axis is contiguous
  long_t q_stride_head;
  long_t kv_stride_block;  // pool element strides (same for K and V); head_dim axis contiguous
  long_t kv_stride_slot;
  long_t kv_stride_head;
  float scale;
  float softcap;           // 0 = off
  int sliding_window;      // 0 = off
  int has_sinks;
  int num_work;            // entries of the work list bound at PA_BUF_WORK
  int partition_size;      // split-KV partition in tokens; 0 = one pass writing `out` directly
  int scratch_heads;       // rows per partition in the partial buffers (see README)
  int pad0;
};

struct ReshapeAndCacheParams {
  int num_tokens;
  int num_kv_heads;
  int head_dim;
  int pad0;
  long_t num_slots;        // num_blocks * block_size; slots >= num_slots are skipped
  long_t key_stride_token;  // element strides of key/value [T, Hkv, D]; head_dim contiguous
  long_t key_stride_head;
  long_t value_stride_token;
  long_t value_stride_head;
  long_t kv_stride_block;  // pool strides (same for both pools)
  long_t kv_stride_slot;
  long_t kv_stride_head;
  int block_size;
  int pad1;
};

#ifdef VLLM_METAL_HOST
}  // namespace vllm_metal::metal_args
#endif
