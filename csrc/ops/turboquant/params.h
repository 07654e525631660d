// Arguments of the TurboQuant Metal kernels (metal_kernels/turboquant/): buffer slots and the
// parameter structs, shared by the kernels and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

// turboquant_write
#define TQW_BUF_KEY 0
#define TQW_BUF_KEY_NORM 1
#define TQW_BUF_VALUE 2
#define TQW_BUF_KEY_CACHE 3
#define TQW_BUF_VALUE_CACHE 4
#define TQW_BUF_SLOT_MAPPING 5
#define TQW_BUF_CENTROIDS 6
#define TQW_BUF_PARAMS 7

// turboquant_decode_d* and turboquant_reduce_d*
#define TQA_BUF_QUERY 0
#define TQA_BUF_KEY_CACHE 1
#define TQA_BUF_VALUE_CACHE 2
#define TQA_BUF_BLOCK_TABLES 3
#define TQA_BUF_SEQ_LENS 4
#define TQA_BUF_CU_SEQLENS_Q 5
#define TQA_BUF_SINKS 6
#define TQA_BUF_CENTROIDS 7
#define TQA_BUF_OUT 8
#define TQA_BUF_WORK 9
#define TQA_BUF_PARTIAL_ML 10
#define TQA_BUF_PARTIAL_OUT 11
#define TQA_BUF_PARAMS 12

VM_KERNEL_ARGS_BEGIN

struct TurboQuantWriteParams {
  int num_rows;            // tokens * KV heads
  int num_kv_heads;
  int head_dim;
  int block_size;
  long_t num_slots;        // slots past this (and negative ones) are skipped
  long_t kc_stride_block;  // byte strides of the key pool; a row's bytes are contiguous
  long_t kc_stride_slot;
  long_t kc_stride_head;
  long_t vc_stride_block;  // and of the value pool
  long_t vc_stride_slot;
  long_t vc_stride_head;
  int key_bits;            // 8: fp8 keys; 3 / 4: MSE indices and a norm
  int value_bits;
};

struct TurboQuantAttentionParams {
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int num_blocks;          // block ids outside [0, num_blocks) read as zero keys and values
  int block_size;
  int max_blocks_per_seq;  // row stride of block_tables
  long_t kc_stride_block;
  long_t kc_stride_slot;
  long_t kc_stride_head;
  long_t vc_stride_block;
  long_t vc_stride_slot;
  long_t vc_stride_head;
  float scale;
  float softcap;           // 0 = off
  int sliding_window;      // 0 = off
  int has_sinks;
  int key_bits;
  int value_bits;
  int norm_correction;
  int head_chunks;         // threadgroups per KV head (VM_TQ_GROUP_HEADS query heads each)
  int partition_size;      // split-KV partition in keys; 0 = one pass writing `out`
  int num_partitions;      // grid z
};

VM_KERNEL_ARGS_END
