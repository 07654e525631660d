// The planner of causal_conv1d's Metal dispatch (see plan.h).
#include "ops/short_conv/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* name;
};

#define VM_SHORT_CONV_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_SHORT_CONV(DT)},
const Instance kShortConv[] = {VM_SHORT_CONV_INSTANCES(VM_SHORT_CONV_)};
#undef VM_SHORT_CONV_

}  // namespace

ShortConvLaunch select_causal_conv1d_kernel(const std::string& dtype, int num_tokens,
                                            int num_seqs, int channels, int width) {
  const auto* it = std::find_if(std::begin(kShortConv), std::end(kShortConv),
                                [&](const Instance& k) { return dtype == k.dtype; });
  if (it == std::end(kShortConv)) {
    throw std::invalid_argument("causal_conv1d: unsupported dtype '" + dtype + "'");
  }
  ShortConvLaunch l;
  l.kernel = it->name;
  const int warps = (std::max(1, channels) + VM_SIMD_WIDTH - 1) / VM_SIMD_WIDTH;
  l.threads = std::min(VM_SHORT_CONV_MAX_THREADS, warps * VM_SIMD_WIDTH);
  l.grid[0] = (channels + l.threads - 1) / l.threads;
  l.grid[1] = num_tokens + num_seqs * (width - 1);
  l.grid[2] = 1;
  return l;
}

std::vector<std::string> short_conv_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kShortConv) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
