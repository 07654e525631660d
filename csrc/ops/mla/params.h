// Arguments of the MLA Metal kernels (mla_attention, mla_reshape_and_cache): buffer slots and the
// parameter structs, shared by the kernels (metal_kernels/mla/) and the host encoders (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define MLA_BUF_QUERY 0
#define MLA_BUF_LATENT_CACHE 1
#define MLA_BUF_BLOCK_TABLES 2
#define MLA_BUF_SEQ_LENS 3
#define MLA_BUF_CU_SEQLENS_Q 4
#define MLA_BUF_OUT 5
#define MLA_BUF_PARAMS 6

#define MLC_BUF_LATENT 0
#define MLC_BUF_LATENT_CACHE 1
#define MLC_BUF_SLOT_MAPPING 2
#define MLC_BUF_PARAMS 3

VM_KERNEL_ARGS_BEGIN

// query [T, H, D] (element strides below, D contiguous), latent_cache [NB, BS, D] (strides below,
// D contiguous), block_tables [S, max_blocks_per_seq], seq_lens [S], cu_seqlens_q [S + 1] and out
// [T, H, DV] contiguous. D and DV are the kernel instance's latent_dim and value_dim.
struct MlaAttentionParams {
  int num_tokens;
  int num_seqs;
  int num_heads;
  int num_blocks;
  int block_size;
  int max_blocks_per_seq;
  long_t q_stride_token;
  long_t q_stride_head;
  long_t cache_stride_block;
  long_t cache_stride_slot;
  float scale;
  int pad0;
};

// latent [T, D] (token stride below, D contiguous) written to latent_cache [NB, BS, D] (strides
// below, D contiguous) at slot_mapping [T] (int64).
struct MlaReshapeAndCacheParams {
  int num_tokens;
  int latent_dim;
  long_t num_slots;  // num_blocks * block_size; slots >= num_slots are skipped
  long_t latent_stride_token;
  long_t cache_stride_block;
  long_t cache_stride_slot;
  int block_size;
  int pad0;
};

VM_KERNEL_ARGS_END
