// The planner of causal_conv1d's Metal dispatch: kernel instance, threadgroup size and grid.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct ShortConvLaunch {
  std::string kernel;
  int threads = 0;          // one thread per channel of a row
  int grid[3] = {0, 0, 0};  // (channel blocks, T + S * (K - 1) rows, 1)
};

// Throws std::invalid_argument for a dtype tag without a kernel.
ShortConvLaunch select_causal_conv1d_kernel(const std::string& dtype, int num_tokens,
                                            int num_seqs, int channels, int width);

// Every causal_conv1d kernel name the planner can return.
std::vector<std::string> short_conv_kernel_names();

}  // namespace vllm_metal
