// The planner of mamba2_scan's Metal dispatch: kernel instance, threadgroup size and grid.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct Mamba2Launch {
  std::string kernel;
  int threads = 0;          // VM_MAMBA2_ROWS simdgroups, one state row (head-dim entry) each
  int grid[3] = {0, 0, 0};  // (state-row blocks, heads, sequences)
};

// Throws std::invalid_argument for a dtype tag without a kernel or a state size above
// VM_MAMBA2_MAX_STATE_DIM.
Mamba2Launch select_mamba2_scan_kernel(const std::string& dtype, int num_heads, int head_dim,
                                       int state_dim, int num_seqs);

// Every mamba2_scan kernel name the planner can return.
std::vector<std::string> mamba2_kernel_names();

}  // namespace vllm_metal
