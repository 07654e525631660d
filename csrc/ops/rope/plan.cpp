// The planner of rotary_embedding's Metal dispatch (see plan.h).
#include "ops/rope/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* cache_dtype;
  const char* positions_dtype;
  const char* name;
};

#define VM_ROPE_(DT, T, BYTES, CDT, CT, PT, PTYPE) \
  {#DT, #CDT, #PT, VM_KERNEL_NAME_ROPE(DT, CDT, PT)},
const Instance kRope[] = {VM_ROPE_INSTANCES(VM_ROPE_)};
#undef VM_ROPE_

}  // namespace

RopeLaunch select_rotary_embedding_kernel(const std::string& dtype, const std::string& cache_dtype,
                                          const std::string& positions_dtype, int num_tokens,
                                          int num_heads, int head_size) {
  const auto* it = std::find_if(std::begin(kRope), std::end(kRope), [&](const Instance& k) {
    return dtype == k.dtype && cache_dtype == k.cache_dtype && positions_dtype == k.positions_dtype;
  });
  if (it == std::end(kRope)) {
    throw std::invalid_argument("rotary_embedding: no kernel for dtype '" + dtype +
                                "' with a '" + cache_dtype + "' cos_sin_cache and '" +
                                positions_dtype + "' positions");
  }
  RopeLaunch l;
  l.kernel = it->name;
  // One thread per element pair of each head: the rotation pairs, then the pass-through elements
  // two at a time.
  const int per_token = std::max(0, num_heads) * ((std::max(0, head_size) + 1) / 2);
  const int warps = (std::max(1, per_token) + VM_SIMD_WIDTH - 1) / VM_SIMD_WIDTH;
  l.threads = std::min(VM_ROPE_MAX_THREADS, warps * VM_SIMD_WIDTH);
  l.grid[0] = (per_token + l.threads - 1) / l.threads;
  l.grid[1] = num_tokens;
  l.grid[2] = 1;
  return l;
}

std::vector<std::string> rope_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kRope) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
