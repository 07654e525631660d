// Writes each step token's latent row into its slot of the paged latent cache.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers (long slot ids),
// uint [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[threads_per_threadgroup]], half / bfloat / float.
//
// Grid: one threadgroup per token (x = token), any multiple of 32 threads (the host uses
// min(VM_CACHE_MAX_THREADS, round_up(D, 32))). Thread i copies columns i, i + threads, ... of the
// row. A negative slot (padding) or one >= num_slots skips the token (uniform per threadgroup).

#include <metal_stdlib>

#include "constants.h"
#include "ops/mla/params.h"

using namespace metal;

template <typename T>
[[kernel]] void mla_reshape_and_cache(
    const device T* latent [[buffer(MLC_BUF_LATENT)]],
    device T* latent_cache [[buffer(MLC_BUF_LATENT_CACHE)]],
    const device long* slot_mapping [[buffer(MLC_BUF_SLOT_MAPPING)]],
    constant MlaReshapeAndCacheParams& p [[buffer(MLC_BUF_PARAMS)]],
    uint token [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint num_threads [[threads_per_threadgroup]]) {
  if (int(token) >= p.num_tokens) {
    return;
  }
  const long slot = slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) {
    return;
  }
  const long dst = (slot / p.block_size) * p.cache_stride_block +
                   (slot % p.block_size) * p.cache_stride_slot;
  const long src = long(token) * p.latent_stride_token;
  for (int d = int(tid); d < p.latent_dim; d += int(num_threads)) {
    latent_cache[dst + d] = latent[src + d];
  }
}

// Instances: VM_MLA_CACHE_INSTANCES of constants.h.
#define MLC_INSTANTIATE(DT, T, BYTES)                                                        \
  template [[host_name(VM_KERNEL_NAME_MLA_CACHE(DT))]] [[kernel]]                            \
  decltype(mla_reshape_and_cache<T>) mla_reshape_and_cache<T>;

VM_MLA_CACHE_INSTANCES(MLC_INSTANTIATE)
