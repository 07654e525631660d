// Arguments of the mamba2_scan Metal kernel: buffer slots and the parameter struct, shared by the
// kernel (metal_kernels/mamba2/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define M2_BUF_X 0
#define M2_BUF_DT 1
#define M2_BUF_A 2
#define M2_BUF_B 3
#define M2_BUF_C 4
#define M2_BUF_D 5
#define M2_BUF_STATE 6
#define M2_BUF_CU_SEQLENS 7
#define M2_BUF_OUT 8
#define M2_BUF_STATE_OUT 9
#define M2_BUF_PARAMS 10

VM_KERNEL_ARGS_BEGIN

// Every buffer is contiguous: x/out [T, H, P] and B/C [T, G, N] of one float dtype; dt [T, H],
// A/D [H], state/state_out [S, H, P, N] float32; cu_seqlens [S + 1] int32.
struct Mamba2ScanParams {
  int num_tokens;
  int num_seqs;
  int num_heads;
  int num_groups;
  int head_dim;   // P
  int state_dim;  // N
};

VM_KERNEL_ARGS_END
