// The planner of gated_delta_rule's Metal dispatch: kernel instance, threadgroup size and grid.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct GatedDeltaLaunch {
  std::string kernel;
  int threads = 0;          // VM_GATED_DELTA_ROWS simdgroups, one value row each
  int grid[3] = {0, 0, 0};  // (value-row blocks, value heads, sequences)
};

// Throws std::invalid_argument for a dtype tag without a kernel or a key head dim above
// VM_GATED_DELTA_MAX_KEY_DIM.
GatedDeltaLaunch select_gated_delta_rule_kernel(const std::string& dtype, int num_v_heads,
                                                int key_dim, int value_dim, int num_seqs);

// Every gated_delta_rule kernel name the planner can return.
std::vector<std::string> gated_delta_kernel_names();

}  // namespace vllm_metal
