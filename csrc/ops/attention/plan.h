// The planner of paged_attention's Metal dispatches: which kernel instances, grids and work lists
// one call needs. Plain structs in and out, so the rules are unit-tested on any host (through
// _C.select_paged_attention_kernel) and the macOS encoder (metal.cpp) only follows the plan.
//
// Kernels are chosen among the instances of constants.h by their tag, head size and block divisor;
// the tile rules there are the ones the kernels' templates apply.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "constants.h"

namespace vllm_metal {

struct DeviceCaps {
  bool supports_nax = false;  // M5-class GPU, OS with Metal 4 tensors, NAX kernels in the library
  int gpu_cores = VM_DEFAULT_GPU_CORES;  // split-KV aims at VM_SPLIT_THREADGROUPS_PER_CORE each
};

// The caps the GPU path plans with: gpu_cores as set for this device (common/device.h).
DeviceCaps device_caps(bool supports_nax);

struct AttentionShape {
  std::string dtype;  // a dtype tag of constants.h ("f16"): the query's, and the pools' unless fp8
  bool fp8_pools = false;  // uint8 fp8 pools: the _fp8 instances (the format is a kernel argument)
  int num_q_heads = 0;
  int num_kv_heads = 0;  // > 0 and dividing num_q_heads (validated by vllm_metal.ops)
  int head_dim = 0;
  int block_size = 0;      // vLLM block size
  int sliding_window = 0;  // 0 = none
};

// One kernel dispatch of a paged-attention call.
struct AttentionLaunch {
  std::string family;  // "prefill", "nax", "decode" or "gqa"
  std::string kernel;
  int grid[3] = {1, 1, 1};  // threadgroups
  int threads = 0;          // threads per threadgroup
  int rows_per_tile = 0;    // prefill/nax: flattened (token, head) rows per work entry
  int kernel_block = 0;     // keys per KV tile
  // prefill/nax: (seq, tile) pairs; decode/gqa: sequence ids (one decode row each).
  std::vector<int32_t> work;
  // Split-KV (decode/gqa only; partition_size == 0 means one pass).
  int partition_size = 0;
  std::vector<int32_t> part_offsets;  // [rows + 1] prefix sums of each row's own partition count
  int total_partitions = 0;
  int scratch_heads = 0;  // rows per partition in the partial buffers
  std::string reduce_kernel;
  int reduce_grid[3] = {1, 1, 1};
  int reduce_threads = 0;
};

struct AttentionPlan {
  std::vector<AttentionLaunch> launches;  // independent dispatches (disjoint output rows)
};

// Plans one paged-attention call from its shapes and the host copies of cu_seqlens_q [S + 1] and
// seq_lens [S]. Reads VLLM_METAL_DISABLE_GQA_DECODE and VLLM_METAL_DISABLE_NAX. Throws
// std::invalid_argument when no kernel instance serves the dtype / head size / block size.
AttentionPlan select_paged_attention_kernel(
    const AttentionShape& shape, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
    int num_seqs, const DeviceCaps& caps);

// Every paged-attention kernel name the planner can return, for any shape, flag and device.
std::vector<std::string> attention_kernel_names();

}  // namespace vllm_metal
