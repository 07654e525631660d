// Arguments of the causal_conv1d Metal kernel: buffer slots and the parameter struct, shared by
// the kernel (metal_kernels/short_conv/) and the host encoder (metal.cpp).
#pragma once

#include "common/kernel_args.h"

#define SC_BUF_X 0
#define SC_BUF_WEIGHT 1
#define SC_BUF_CONV_STATE 2
#define SC_BUF_CU_SEQLENS 3
#define SC_BUF_BIAS 4
#define SC_BUF_OUT 5
#define SC_BUF_STATE_OUT 6
#define SC_BUF_PARAMS 7

VM_KERNEL_ARGS_BEGIN

// Every buffer is contiguous and of one dtype: x/out [T, C], weight [C, K], bias [C] (read only
// when has_bias; another buffer stands in otherwise), conv_state/state_out [S, K - 1, C];
// cu_seqlens [S + 1] int32.
struct CausalConv1dParams {
  int num_tokens;
  int num_seqs;
  int channels;
  int width;  // K
  int has_bias;
};

VM_KERNEL_ARGS_END
