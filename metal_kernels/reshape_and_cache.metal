// Writes each step token's key and value rows into its slot of the paged K/V pools.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers (long slot ids),
// uint [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[threads_per_threadgroup]], half / bfloat / float.
//
// Grid: one threadgroup per token (x = token), any multiple of 32 threads (the host uses
// min(256, round_up(Hkv * D, 32))). Thread i copies elements i, i + threads, ... of the token's
// Hkv * D block, so consecutive threads touch consecutive addresses (coalesced both ways).
// A negative slot (padding) or one >= num_slots skips the token; the check is uniform per
// threadgroup, so the early return does not split a threadgroup.

#include <metal_stdlib>

#include "attention_params.h"

using namespace metal;

template <typename T>
[[kernel]] void reshape_and_cache(
    const device T* key [[buffer(0)]],
    const device T* value [[buffer(1)]],
    device T* key_cache [[buffer(2)]],
    device T* value_cache [[buffer(3)]],
    const device long* slot_mapping [[buffer(4)]],
    constant ReshapeAndCacheParams& p [[buffer(5)]],
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

#define PA_INSTANTIATE_CACHE(NAME, T) \
  template [[host_name(NAME)]] [[kernel]] decltype(reshape_and_cache<T>) reshape_and_cache<T>;

PA_INSTANTIATE_CACHE("reshape_and_cache_f32", float)
PA_INSTANTIATE_CACHE("reshape_and_cache_f16", half)
PA_INSTANTIATE_CACHE("reshape_and_cache_bf16", bfloat)
