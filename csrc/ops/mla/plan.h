// The planners of the MLA ops' Metal dispatches: kernel instance, threadgroup size and grid.
#pragma once

#include <string>
#include <vector>

namespace vllm_metal {

struct MlaLaunch {
  std::string kernel;
  int threads = 0;          // per threadgroup
  int grid[3] = {0, 0, 0};  // threadgroups
  int keys = 0;             // mla_attention: latent rows per staged tile (0 for the cache write)
};

// mla_attention: min(VM_MLA_HEADS, H) simdgroups per threadgroup, one query head each; grid
// (head groups, tokens). Throws std::invalid_argument for a dtype tag or (latent_dim, value_dim)
// without a kernel (VM_MLA_SIZES).
MlaLaunch select_mla_attention_kernel(const std::string& dtype, int num_heads, int latent_dim,
                                      int value_dim, int num_tokens);

// mla_reshape_and_cache: one threadgroup per token. Throws std::invalid_argument for a dtype tag
// without a kernel.
MlaLaunch select_mla_reshape_and_cache_kernel(const std::string& dtype, int latent_dim,
                                              int num_tokens);

// Every MLA kernel name the planners can return.
std::vector<std::string> mla_kernel_names();

}  // namespace vllm_metal
