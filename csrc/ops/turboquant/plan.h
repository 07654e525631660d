// The planner of the TurboQuant Metal dispatches: kernels, grids and work lists of one call, from
// plain numbers (unit-tested on any host through _C.select_turboquant_*; metal.cpp follows it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vllm_metal {

struct TqWriteLaunch {
  std::string kernel;
  int grid = 1;     // threadgroups (x)
  int threads = 0;  // per threadgroup; one row (token, KV head) a thread
};

TqWriteLaunch select_turboquant_write_kernel(int num_tokens, int num_kv_heads);

struct TqAttentionLaunch {
  std::string kernel, reduce_kernel;  // reduce_kernel: empty for one pass
  int grid[3] = {1, 1, 1};            // tokens, KV heads x head chunks, partitions
  int threads = 0;
  int reduce_grid[3] = {1, 1, 1};  // tokens, query heads
  int reduce_threads = 0;
  int head_chunks = 1;
  int partition_size = 0;  // 0: one pass
  int num_partitions = 1;
  std::vector<int32_t> work;  // per token: its sequence, or -1 (padding)
};

// One attention call over T = cu_seqlens_q[num_seqs] (or more: num_tokens) query rows. Throws
// std::invalid_argument when no kernel instance serves head_dim.
TqAttentionLaunch select_turboquant_attention_kernel(int head_dim, int num_q_heads,
                                                     int num_kv_heads, int num_tokens,
                                                     const int32_t* cu_seqlens_q,
                                                     const int32_t* seq_lens, int num_seqs,
                                                     int sliding_window, int gpu_cores);

std::vector<std::string> turboquant_kernel_names();

}  // namespace vllm_metal
