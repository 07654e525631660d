// The planner of reshape_and_cache's Metal dispatch (see plan.h).
#include "ops/cache/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* name;
};

#define VM_CACHE_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_CACHE(DT)},
#define VM_CACHE_FP8_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_CACHE_FP8(DT)},
const Instance kCache[] = {VM_CACHE_INSTANCES(VM_CACHE_)};
const Instance kCacheFp8[] = {VM_CACHE_INSTANCES(VM_CACHE_FP8_)};
#undef VM_CACHE_
#undef VM_CACHE_FP8_

}  // namespace

CacheLaunch select_reshape_and_cache_kernel(const std::string& dtype, int num_kv_heads,
                                            int head_dim, bool fp8_pools) {
  const Instance* begin = fp8_pools ? std::begin(kCacheFp8) : std::begin(kCache);
  const Instance* end = fp8_pools ? std::end(kCacheFp8) : std::end(kCache);
  const auto* it = std::find_if(begin, end, [&](const Instance& k) { return dtype == k.dtype; });
  if (it == end) {
    throw std::invalid_argument("reshape_and_cache: unsupported dtype '" + dtype + "'");
  }
  CacheLaunch c;
  c.kernel = it->name;
  const int elems = std::max(1, num_kv_heads * head_dim);
  const int warps = (elems + VM_SIMD_WIDTH - 1) / VM_SIMD_WIDTH;
  c.threads = std::min(VM_CACHE_MAX_THREADS, warps * VM_SIMD_WIDTH);
  return c;
}

std::vector<std::string> cache_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kCache) names.push_back(k.name);
  for (const Instance& k : kCacheFp8) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
