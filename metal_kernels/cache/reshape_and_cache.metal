// Writes each step token's key and value rows into its slot of the paged K/V pools: as they are
// (pools of the rows' type), or quantized to bytes (uint8 pools, the _fp8 instances): fp8 (a row
// element x is stored as fp8(x / k_scale), values with v_scale; common/fp8.h), or per-token-head
// rows (kv_format of VM_PTH_FORMATS: each row's elements, int4 two a byte, with its own scale after
// them; common/per_token_head.h).
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers (long slot ids),
// uint [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[threads_per_threadgroup]], half / bfloat / float / uchar, class template partial
// specialisation, metal::precise::divide, as_type.
//
// Grid: one threadgroup per token (x = token), any multiple of 32 threads (the host uses
// min(VM_CACHE_MAX_THREADS, round_up(Hkv * D, 32))). Thread i copies elements i, i + threads, ...
// of the token's Hkv * D block, so consecutive threads touch consecutive addresses (coalesced both
// ways). Per-token-head pools: thread h stores row h of the keys and of the values whole (its
// scale needs the row's largest magnitude first). A negative slot (padding) or one >= num_slots
// skips the token; the check is uniform per threadgroup, so the early return does not split a
// threadgroup.

#include <metal_stdlib>

#include "common/fp8.h"
#include "common/per_token_head.h"
#include "constants.h"
#include "ops/cache/params.h"

using namespace metal;

// One row element as a pool of KV elements stores it: as it is, or (KV = uchar) the fp8 byte of
// x / scale (a correctly rounded division, as the CPU body's).
template <typename T, typename KV>
struct RcStore {
  static KV store(T x, float scale, int kv_format) { return x; }
};
template <typename T>
struct RcStore<T, uchar> {
  static uchar store(T x, float scale, int kv_format) {
    return uchar(vm_fp8_from_float(metal::precise::divide(float(x), scale), kv_format));
  }
};

// One int4 row (already rotated) of head_dim elements: head_dim / 2 bytes of two levels, then the
// stored scale with the zero point in its low bits.
template <typename T>
inline void rc_store_int4_row(const device T* src, device uchar* dst, int head_dim) {
  float low = float(src[0]);
  float high = low;
  for (int d = 1; d < head_dim; ++d) {
    low = metal::min(low, float(src[d]));
    high = metal::max(high, float(src[d]));
  }
  const float scale = vm_pth_int4_scale_of(low, high);
  const uint zp = vm_pth_int4_zero(low, scale);
  const float inv = vm_pth_inverse(scale);
  for (int d = 0; d + 1 < head_dim; d += 2) {
    const uint even = vm_pth_int4_store(float(src[d]), inv, zp);
    const uint odd = vm_pth_int4_store(float(src[d + 1]), inv, zp);
    dst[d / 2] = uchar(even | (odd << 4));
  }
  const float stored = vm_pth_int4_stored_scale(scale, zp);
  for (int i = 0; i < VM_PTH_SCALE_BYTES; ++i) {
    dst[head_dim / 2 + i] = uchar(vm_pth_scale_byte(stored, i));
  }
}

// One row of head_dim elements stored as a per-token-head row of format kv_format: the element
// bytes, then the row's scale (four bytes).
template <typename T>
inline void rc_store_pth_row(const device T* src, device uchar* dst, int head_dim, int kv_format) {
  if (vm_pth_int4(kv_format)) {
    rc_store_int4_row(src, dst, head_dim);
    return;
  }
  float absmax = 0.0f;
  for (int d = 0; d < head_dim; ++d) {
    absmax = metal::max(absmax, metal::fabs(float(src[d])));
  }
  const float scale = vm_pth_scale_of(absmax, kv_format);
  const float inv = vm_pth_inverse(scale);
  for (int d = 0; d < head_dim; ++d) {
    dst[d] = uchar(vm_pth_store(float(src[d]), inv, kv_format));
  }
  for (int i = 0; i < VM_PTH_SCALE_BYTES; ++i) {
    dst[head_dim + i] = uchar(vm_pth_scale_byte(scale, i));
  }
}

// Rows whose pools are not per-token-head, or no pool of bytes: nothing to do (the caller checks).
template <typename T, typename KV>
struct RcPthRows {
  static bool store(const device T* key, const device T* value, device KV* key_cache,
                    device KV* value_cache, long dst_base, uint token, uint tid,
                    constant ReshapeAndCacheParams& p) {
    return false;
  }
};
template <typename T>
struct RcPthRows<T, uchar> {
  // Stores the token's rows when the pools are per-token-head (true), else leaves them (false).
  static bool store(const device T* key, const device T* value, device uchar* key_cache,
                    device uchar* value_cache, long dst_base, uint token, uint tid,
                    constant ReshapeAndCacheParams& p) {
    if (!vm_pth_is(p.kv_format)) {
      return false;
    }
    const int h = int(tid);
    if (h < p.num_kv_heads) {
      const long dst = dst_base + long(h) * p.kv_stride_head;
      rc_store_pth_row(key + long(token) * p.key_stride_token + long(h) * p.key_stride_head,
                       key_cache + dst, p.head_dim, p.kv_format);
      rc_store_pth_row(value + long(token) * p.value_stride_token + long(h) * p.value_stride_head,
                       value_cache + dst, p.head_dim, p.kv_format);
    }
    return true;
  }
};

template <typename T, typename KV>
[[kernel]] void reshape_and_cache(
    const device T* key [[buffer(RC_BUF_KEY)]],
    const device T* value [[buffer(RC_BUF_VALUE)]],
    device KV* key_cache [[buffer(RC_BUF_KEY_CACHE)]],
    device KV* value_cache [[buffer(RC_BUF_VALUE_CACHE)]],
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
  if (RcPthRows<T, KV>::store(key, value, key_cache, value_cache, dst_base, token, tid, p)) {
    return;
  }
  const int row = p.head_dim;
  const int total = p.num_kv_heads * row;
  for (int i = int(tid); i < total; i += int(num_threads)) {
    const int h = i / row;
    const int d = i - h * row;
    const long dst = dst_base + long(h) * p.kv_stride_head + d;
    key_cache[dst] = RcStore<T, KV>::store(
        key[long(token) * p.key_stride_token + long(h) * p.key_stride_head + d], p.k_scale,
        p.kv_format);
    value_cache[dst] = RcStore<T, KV>::store(
        value[long(token) * p.value_stride_token + long(h) * p.value_stride_head + d], p.v_scale,
        p.kv_format);
  }
}

// Instances: VM_CACHE_INSTANCES of constants.h, into pools of the rows' type and fp8 pools.
#define RC_INSTANTIATE(DT, T, BYTES)                                                         \
  template [[host_name(VM_KERNEL_NAME_CACHE(DT))]] [[kernel]]                                \
  decltype(reshape_and_cache<T, T>) reshape_and_cache<T, T>;
#define RC_INSTANTIATE_FP8(DT, T, BYTES)                                                     \
  template [[host_name(VM_KERNEL_NAME_CACHE_FP8(DT))]] [[kernel]]                            \
  decltype(reshape_and_cache<T, uchar>) reshape_and_cache<T, uchar>;

VM_CACHE_INSTANCES(RC_INSTANTIATE)
VM_CACHE_INSTANCES(RC_INSTANTIATE_FP8)
