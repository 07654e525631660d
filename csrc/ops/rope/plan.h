// The planner of rotary_embedding's Metal dispatch: kernel instance, threadgroup size and grid.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct RopeLaunch {
  std::string kernel;
  int threads = 0;          // one thread per (head, element pair) of a token
  int grid[3] = {0, 0, 0};  // (blocks of a token's (head, pair) threads, T, 1)
};

// dtype and cache_dtype are dtype tags ("f16", ...), positions_dtype "i32" or "i64"; num_heads
// counts query and key heads together. Throws std::invalid_argument for a combination without a
// kernel.
RopeLaunch select_rotary_embedding_kernel(const std::string& dtype, const std::string& cache_dtype,
                                          const std::string& positions_dtype, int num_tokens,
                                          int num_heads, int head_size);

// Every rotary_embedding kernel name the planner can return.
std::vector<std::string> rope_kernel_names();

}  // namespace vllm_metal
