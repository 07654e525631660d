// The planner of gated_delta_rule's Metal dispatch (see plan.h).
#include "ops/gated_delta/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* name;
};

#define VM_GATED_DELTA_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_GATED_DELTA(DT)},
const Instance kGatedDelta[] = {VM_GATED_DELTA_INSTANCES(VM_GATED_DELTA_)};
#undef VM_GATED_DELTA_

}  // namespace

GatedDeltaLaunch select_gated_delta_rule_kernel(const std::string& dtype, int num_v_heads,
                                                int key_dim, int value_dim, int num_seqs) {
  const auto* it = std::find_if(std::begin(kGatedDelta), std::end(kGatedDelta),
                                [&](const Instance& k) { return dtype == k.dtype; });
  if (it == std::end(kGatedDelta)) {
    throw std::invalid_argument("gated_delta_rule: unsupported dtype '" + dtype + "'");
  }
  if (key_dim > VM_GATED_DELTA_MAX_KEY_DIM) {
    throw std::invalid_argument("gated_delta_rule: the Metal kernel takes key head dims up to " +
                                std::to_string(VM_GATED_DELTA_MAX_KEY_DIM));
  }
  GatedDeltaLaunch l;
  l.kernel = it->name;
  l.threads = VM_GATED_DELTA_ROWS * VM_SIMD_WIDTH;
  l.grid[0] = (value_dim + VM_GATED_DELTA_ROWS - 1) / VM_GATED_DELTA_ROWS;
  l.grid[1] = num_v_heads;
  l.grid[2] = num_seqs;
  return l;
}

std::vector<std::string> gated_delta_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kGatedDelta) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
