// Arguments of the reshape_and_cache Metal kernel: buffer slots and the parameter struct, shared by
// the kernel (metal_kernels/cache/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define RC_BUF_KEY 0
#define RC_BUF_VALUE 1
#define RC_BUF_KEY_CACHE 2
#define RC_BUF_VALUE_CACHE 3
#define RC_BUF_SLOT_MAPPING 4
#define RC_BUF_PARAMS 5

VM_KERNEL_ARGS_BEGIN

struct ReshapeAndCacheParams {
  int num_tokens;
  int num_kv_heads;
  int head_dim;
  int pad0;
  long_t num_slots;         // num_blocks * block_size; slots >= num_slots are skipped
  long_t key_stride_token;  // element strides of key/value [T, Hkv, D]; head_dim contiguous
  long_t key_stride_head;
  long_t value_stride_token;
  long_t value_stride_head;
  long_t kv_stride_block;   // pool strides (same for both pools)
  long_t kv_stride_slot;
  long_t kv_stride_head;
  int block_size;
  int kv_format;            // VM_KV_FORMAT_SAME, or the fp8 format id of uint8 pools (_fp8 kernels)
  float k_scale;            // fp8 pools: a key element x is stored as fp8(x / k_scale)
  float v_scale;            // and a value element as fp8(x / v_scale)
};

VM_KERNEL_ARGS_END
