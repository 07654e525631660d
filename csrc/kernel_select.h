// Host-side choice of the Metal kernel for each op: one function per op, plain structs out.
//
// Shared by the macOS eval_gpu bodies (csrc/metal/) and the Python bindings used by tests, so the
// choice rules can be checked on any host. Kernel names match the [[host_name]] instantiations in
// metal_kernels/*.metal; all_kernel_names() lists every name the host can request.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

namespace vllm_metal {

// Decode rows at least this long (attended keys) leave a mixed batch for the decode kernels.
constexpr int kDecodeSplitOutContext = 4096;
// Keys per split-KV partition (multiple of every kernel block and of PA_PARTITION_ALIGN).
constexpr int kPartitionSize = 512;
// Metal's guaranteed threadgroup memory on Apple GPUs.
constexpr int kThreadgroupMemoryBytes = 32768;

struct DeviceCaps {
  bool supports_nax = false;  // M5-class GPU, OS with Metal 4 tensors, NAX kernels in the library
  int gpu_cores = 16;         // split-KV fills about 8 threadgroups per core
};

struct AttentionShape {
  std::string dtype;  // "f32", "f16" or "bf16" (query and caches share it)
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;      // vLLM block size; a multiple of 8
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
// std::invalid_argument for unsupported dtype / head_dim / block_size combinations.
AttentionPlan select_paged_attention_kernel(
    const AttentionShape& shape, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
    int num_seqs, const DeviceCaps& caps);

struct CacheLaunch {
  std::string kernel;
  int threads = 0;  // per threadgroup; one threadgroup per token
};

CacheLaunch select_reshape_and_cache_kernel(
    const std::string& dtype, int num_kv_heads, int head_dim);

// Every kernel name select_* can return, for any shape, flag and device.
std::vector<std::string> all_kernel_names();

// True when the environment variable is set to 1/true/yes/on (case-insensitive).
bool env_flag(const char* name);

// Adds the kernel-choice functions to the extension module (for tests and diagnostics).
void bind_kernel_select(nanobind::module_& m);

}  // namespace vllm_metal
