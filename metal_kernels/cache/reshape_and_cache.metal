// Writes each step token's key and value rows into its slot of the paged K/V pools.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers (long slot ids),
// uint [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[threads_per_threadgroup]], half / bfloat / float.
//
// Grid: one threadgroup per token (x = token), any multiple of 32 threads (the host uses
// min(VM_CACHE_MAX_THREADS, round_up(Hkv * D, 32))). Thread i copies elements i, i + threads, ...
// of the token's Hkv * D block, so consecutive threads touch consecutive addresses (coalesced both
// ways). A negative slot (padding) or one >= num_slots skips the token; the check is uniform per
// threadgroup, so the early return does not split a threadgroup.

#include <metal_stdlib>

#include "constants.h"
#include "ops/cache/params.h"

using namespace metal;

template <typename T>
[[kernel]] void reshape_and_cache(
    const device T* key [[buffer(RC_BUF_KEY)]],
    const device T* value [[buffer(RC_BUF_VALUE)]],
    device T* key_cache [[buffer(RC_BUF_KEY_CACHE)]],
    device T* value_cache [[buffer(RC_BUF_VALUE_CACHE)]],
    const device long* slot_mapping [[buffer(RC_BUF_SLOT_MAPPING)]],
    constant ReshapeAndCacheParams& p [[buffer(RC_BUF_PARAMS)]],
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
  const long block = slot / p.block_size;
  const long offset = slot % p.block_size;
  const long dst_base = block * p.kv_stride_block + offset * p.kv_stride_slot;
  const int row = p.head_dim;
  const int total = p.num_kv_heads * row;
  for (int i = int(tid); i < total; i += int(num_threads)) {
    const int h = i / row;
    const int d = i - h * row;
    const long dst = dst_base + long(h) * p.kv_stride_head + d;
    key_cache[dst] = key[long(token) * p.key_stride_token + long(h) * p.key_stride_head + d];
    value_cache[dst] =
        value[long(token) * p.value_stride_token + long(h) * p.value_stride_head + d];
  }
}

// Instances: VM_CACHE_INSTANCES of constants.h.
#define RC_INSTANTIATE(DT, T, BYTES)                                                         \
  template [[host_name(VM_KERNEL_NAME_CACHE(DT))]] [[kernel]]                                \
  decltype(reshape_and_cache<T>) reshape_and_cache<T>;

VM_CACHE_INSTANCES(RC_INSTANTIATE)
