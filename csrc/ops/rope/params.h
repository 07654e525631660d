// Arguments of the rotary_embedding Metal kernel: buffer slots and the parameter struct, shared by
// the kernel (metal_kernels/rope/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define ROPE_BUF_POSITIONS 0
#define ROPE_BUF_QUERY 1
#define ROPE_BUF_KEY 2
#define ROPE_BUF_COS_SIN_CACHE 3
#define ROPE_BUF_QUERY_OUT 4
#define ROPE_BUF_KEY_OUT 5
#define ROPE_BUF_PARAMS 6

VM_KERNEL_ARGS_BEGIN

// positions [T] and cos_sin_cache [max_position, rotary_dim] contiguous; query [T, Hq, D] and key
// [T, Hkv, D] read through their element strides (any sign); query_out and key_out contiguous, of
// the query's dtype. A call without key heads binds another buffer in the key slots (never read or
// written).
struct RotaryEmbeddingParams {
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int head_size;         // D
  int rotary_dim;        // R: even, <= D; elements [0, R) of each head rotate, [R, D) pass through
  int max_position;      // rows of cos_sin_cache; positions are clamped to [0, max_position - 1]
  int is_neox;           // 1: halves [x1 | x2]; 0: GPT-J interleaved pairs (x[2i], x[2i + 1])
  int pad0;
  long_t q_stride_token;
  long_t q_stride_head;
  long_t q_stride_dim;
  long_t k_stride_token;
  long_t k_stride_head;
  long_t k_stride_dim;
};

VM_KERNEL_ARGS_END
