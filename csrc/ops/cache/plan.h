// The planner of reshape_and_cache's Metal dispatch: kernel instance and threadgroup size.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct CacheLaunch {
  std::string kernel;
  int threads = 0;  // per threadgroup; one threadgroup per token
};

// Throws std::invalid_argument for a dtype tag without a kernel. dtype: the rows'; fp8_pools:
// uint8 pools of an fp8 format (the _fp8 instances, which quantize).
CacheLaunch select_reshape_and_cache_kernel(const std::string& dtype, int num_kv_heads,
                                            int head_dim, bool fp8_pools = false);

// Every reshape_and_cache kernel name the planner can return.
std::vector<std::string> cache_kernel_names();

}  // namespace vllm_metal
