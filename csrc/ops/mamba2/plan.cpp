// The planner of mamba2_scan's Metal dispatch (see plan.h).
#include "ops/mamba2/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* name;
};

#define VM_MAMBA2_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_MAMBA2(DT)},
const Instance kMamba2[] = {VM_MAMBA2_INSTANCES(VM_MAMBA2_)};
#undef VM_MAMBA2_

}  // namespace

Mamba2Launch select_mamba2_scan_kernel(const std::string& dtype, int num_heads, int head_dim,
                                       int state_dim, int num_seqs) {
  const auto* it = std::find_if(std::begin(kMamba2), std::end(kMamba2),
                                [&](const Instance& k) { return dtype == k.dtype; });
  if (it == std::end(kMamba2)) {
    throw std::invalid_argument("mamba2_scan: unsupported dtype '" + dtype + "'");
  }
  if (state_dim > VM_MAMBA2_MAX_STATE_DIM) {
    throw std::invalid_argument("mamba2_scan: the Metal kernel takes state sizes up to " +
                                std::to_string(VM_MAMBA2_MAX_STATE_DIM));
  }
  Mamba2Launch l;
  l.kernel = it->name;
  l.threads = VM_MAMBA2_ROWS * VM_SIMD_WIDTH;
  l.grid[0] = (head_dim + VM_MAMBA2_ROWS - 1) / VM_MAMBA2_ROWS;
  l.grid[1] = num_heads;
  l.grid[2] = num_seqs;
  return l;
}

std::vector<std::string> mamba2_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kMamba2) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
