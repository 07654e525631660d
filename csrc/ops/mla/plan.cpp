// The planners of the MLA ops' Metal dispatches (see plan.h).
#include "ops/mla/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

struct Instance {
  const char* dtype;
  const char* name;
  int latent_dim;
  int value_dim;
  int keys;
};

#define VM_MLA_(DT, T, BYTES, D, DV) \
  {#DT, VM_KERNEL_NAME_MLA(DT, D, DV), D, DV, vm_mla_keys(BYTES, D)},
const Instance kMla[] = {VM_MLA_INSTANCES(VM_MLA_)};
#undef VM_MLA_

#define VM_MLA_CACHE_(DT, T, BYTES) {#DT, VM_KERNEL_NAME_MLA_CACHE(DT), 0, 0, 0},
const Instance kMlaCache[] = {VM_MLA_CACHE_INSTANCES(VM_MLA_CACHE_)};
#undef VM_MLA_CACHE_

}  // namespace

MlaLaunch select_mla_attention_kernel(const std::string& dtype, int num_heads, int latent_dim,
                                      int value_dim, int num_tokens) {
  const auto* it = std::find_if(std::begin(kMla), std::end(kMla), [&](const Instance& k) {
    return dtype == k.dtype && latent_dim == k.latent_dim && value_dim == k.value_dim;
  });
  if (it == std::end(kMla)) {
    throw std::invalid_argument("mla_attention: no Metal kernel for dtype '" + dtype +
                                "', latent_dim " + std::to_string(latent_dim) + ", value_dim " +
                                std::to_string(value_dim));
  }
  MlaLaunch l;
  l.kernel = it->name;
  l.keys = it->keys;
  const int heads = std::clamp(num_heads, 1, VM_MLA_HEADS);
  l.threads = heads * VM_SIMD_WIDTH;
  l.grid[0] = (num_heads + heads - 1) / heads;
  l.grid[1] = num_tokens;
  l.grid[2] = 1;
  return l;
}

MlaLaunch select_mla_reshape_and_cache_kernel(const std::string& dtype, int latent_dim,
                                              int num_tokens) {
  const auto* it = std::find_if(std::begin(kMlaCache), std::end(kMlaCache),
                                [&](const Instance& k) { return dtype == k.dtype; });
  if (it == std::end(kMlaCache)) {
    throw std::invalid_argument("mla_reshape_and_cache: unsupported dtype '" + dtype + "'");
  }
  MlaLaunch l;
  l.kernel = it->name;
  const int warps = (std::max(1, latent_dim) + VM_SIMD_WIDTH - 1) / VM_SIMD_WIDTH;
  l.threads = std::min(VM_CACHE_MAX_THREADS, warps * VM_SIMD_WIDTH);
  l.grid[0] = num_tokens;
  l.grid[1] = 1;
  l.grid[2] = 1;
  return l;
}

std::vector<std::string> mla_kernel_names() {
  std::vector<std::string> names;
  for (const Instance& k : kMla) names.push_back(k.name);
  for (const Instance& k : kMlaCache) names.push_back(k.name);
  return names;
}

}  // namespace vllm_metal
