// Arguments of the paged-attention Metal kernels: buffer slots and the parameter struct, shared by
// the kernels (metal_kernels/attention/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

// Buffer slots, the same for every attention family (unused ones get any bound buffer).
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

VM_KERNEL_ARGS_BEGIN

struct PagedAttentionParams {
  int num_seqs;
  int num_q_heads;
  int num_kv_heads;
  int num_blocks;          // block ids outside [0, num_blocks) read as zero keys/values
  int block_size;          // vLLM block size (a multiple of the kernel's block divisor)
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
  int kv_format;           // VM_KV_FORMAT_SAME, or the fp8 / per-token-head format id of uint8
                           // pools (_fp8 kernels)
  float k_scale;           // fp8 pools: a key reads as value(byte) * k_scale, rounded to the dtype
  float v_scale;           // and a value as value(byte) * v_scale
  int head_dim;            // per-token-head pools: a row's scale follows its head_dim bytes
};

VM_KERNEL_ARGS_END
