// Rotary position embedding of the query and key heads of a step (vLLM's RotaryEmbedding), in
// float32, stored in the heads' dtype.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers, uint3
// [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]], uint
// [[threads_per_threadgroup]], half / bfloat / float, int / long.
//
// Grid: (ceil(H * ceil(D / 2) / threads), T) threadgroups with H = Hq + Hkv; the host uses
// min(VM_ROPE_MAX_THREADS, round_up(H * ceil(D / 2), 32)) threads. Thread i of threadgroup (x, t)
// owns element pair j = n mod ceil(D / 2) of head h = n / ceil(D / 2) (query heads, then key heads)
// of token t, with n = x * threads + i. With R = rotary_dim and half = R / 2, a thread with
// j < half rotates one pair by row pos = clamp(positions[t], 0, max_position - 1) of the cache
// (cos = row[j], sin = row[half + j]): the pair (j, half + j) in neox style, (2j, 2j + 1) in GPT-J
// style, x1' = x1 cos - x2 sin and x2' = x2 cos + x1 sin. A thread with j >= half copies the
// pass-through elements 2j and 2j + 1 (when < D). query and key are read through their element
// strides; the outputs are contiguous [T, H, D].

#include <metal_stdlib>

#include "constants.h"
#include "ops/rope/params.h"

using namespace metal;

template <typename T, typename C, typename P>
[[kernel]] void rotary_embedding(
    const device P* positions [[buffer(ROPE_BUF_POSITIONS)]],
    const device T* query [[buffer(ROPE_BUF_QUERY)]],
    const device T* key [[buffer(ROPE_BUF_KEY)]],
    const device C* cos_sin_cache [[buffer(ROPE_BUF_COS_SIN_CACHE)]],
    device T* query_out [[buffer(ROPE_BUF_QUERY_OUT)]],
    device T* key_out [[buffer(ROPE_BUF_KEY_OUT)]],
    constant RotaryEmbeddingParams& p [[buffer(ROPE_BUF_PARAMS)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint num_threads [[threads_per_threadgroup]]) {
  const int pairs = (p.head_size + 1) / 2;
  const int n = int(tg.x) * int(num_threads) + int(tid);
  const int h = n / pairs;
  const int j = n - h * pairs;
  const int t = int(tg.y);
  if (h >= p.num_q_heads + p.num_kv_heads || t >= p.num_tokens) {
    return;
  }
  const bool is_query = h < p.num_q_heads;
  const int head = is_query ? h : h - p.num_q_heads;
  const int heads = is_query ? p.num_q_heads : p.num_kv_heads;
  const long stride_token = is_query ? p.q_stride_token : p.k_stride_token;
  const long stride_head = is_query ? p.q_stride_head : p.k_stride_head;
  const long sd = is_query ? p.q_stride_dim : p.k_stride_dim;
  const device T* x = (is_query ? query : key) + t * stride_token + head * stride_head;
  device T* o = (is_query ? query_out : key_out) + (long(t) * heads + head) * p.head_size;

  const int half = p.rotary_dim / 2;
  if (j >= half) {  // pass-through elements
    const int e = 2 * j;
    o[e] = x[e * sd];
    if (e + 1 < p.head_size) {
      o[e + 1] = x[(e + 1) * sd];
    }
    return;
  }
  const long raw = long(positions[t]);
  const long pos = raw < 0 ? 0 : (raw >= long(p.max_position) ? long(p.max_position - 1) : raw);
  const device C* row = cos_sin_cache + pos * p.rotary_dim;
  const float c = float(row[j]);
  const float s = float(row[half + j]);
  const bool neox = p.is_neox != 0;
  const int i1 = neox ? j : 2 * j;
  const int i2 = neox ? half + j : 2 * j + 1;
  const float x1 = float(x[i1 * sd]);
  const float x2 = float(x[i2 * sd]);
  o[i1] = T(x1 * c - x2 * s);
  o[i2] = T(x2 * c + x1 * s);
}

// Instances: VM_ROPE_INSTANCES of constants.h.
#define ROPE_INSTANTIATE(DT, T, BYTES, CDT, CT, PT, PTYPE)                                  \
  template [[host_name(VM_KERNEL_NAME_ROPE(DT, CDT, PT))]] [[kernel]]                       \
  decltype(rotary_embedding<T, CT, PTYPE>) rotary_embedding<T, CT, PTYPE>;

VM_ROPE_INSTANCES(ROPE_INSTANTIATE)
