// Arguments of the gated_delta_rule Metal kernel: buffer slots and the parameter struct, shared by
// the kernel (metal_kernels/gated_delta/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define GDR_BUF_Q 0
#define GDR_BUF_K 1
#define GDR_BUF_V 2
#define GDR_BUF_G 3
#define GDR_BUF_BETA 4
#define GDR_BUF_STATE 5
#define GDR_BUF_CU_SEQLENS 6
#define GDR_BUF_OUT 7
#define GDR_BUF_STATE_OUT 8
#define GDR_BUF_PARAMS 9

VM_KERNEL_ARGS_BEGIN

// Every buffer is contiguous: q/k [T, Hk, Dk], v/out [T, Hv, Dv], g/beta [T, Hv],
// state/state_out [S, Hv, Dv, Dk], cu_seqlens [S + 1].
struct GatedDeltaParams {
  int num_tokens;
  int num_seqs;
  int num_k_heads;
  int num_v_heads;
  int key_dim;
  int value_dim;
};

VM_KERNEL_ARGS_END
