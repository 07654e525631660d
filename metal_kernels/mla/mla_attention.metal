// Multi-head latent attention over a paged latent cache: query row t (head h) attends causally to
// its sequence's latent rows; logits are scale * q . row over all latent_dim columns and the value
// is the row's first value_dim columns. Float32 math and softmax.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], `constant` struct reference, `device` pointers, static `threadgroup` arrays,
// threadgroup_barrier, uint2 [[threadgroup_position_in_grid]],
// uint [[thread_index_in_threadgroup]], uint [[threads_per_threadgroup]],
// uint [[thread_index_in_simdgroup]], uint [[simdgroup_index_in_threadgroup]], simd_sum,
// half / bfloat / float.
//
// Grid: (ceil(H / G), T) threadgroups of G simdgroups, G = min(VM_MLA_HEADS, H). Threadgroup (x, t)
// serves token t and heads x * G .. x * G + G - 1, one simdgroup per head (simdgroups past H only
// help staging). The token's sequence s is found by binary search of cu_seqlens_q; its position is
// p = seq_lens[s] - q_len + (t - cu_seqlens_q[s]) and it attends keys 0 .. p. A token outside every
// sequence writes zeros.
//
// The keys are walked in tiles of KEYS = vm_mla_keys(sizeof(T), D) latent rows: the first KEYS
// threads look up the rows' pool offsets (block_tables[s][k / block_size], offset
// k % block_size; -1 past the attended keys or for a block id outside the pool), then all threads
// stage the tile into threadgroup memory (zeros for -1), so every row is read from device memory
// once for the G heads. Lane l of a head's simdgroup holds the query columns l, l + 32, ... and
// the output columns l, l + 32, ... < DV in registers; each key's logit is a simd_sum, and an
// online softmax (running max m, sum l, output rescaled by exp(m_old - m_new)) folds the tile in.

#include <metal_stdlib>

#include "constants.h"
#include "ops/mla/params.h"

using namespace metal;

template <typename T, int D, int DV>
[[kernel]] void mla_attention(
    const device T* query [[buffer(MLA_BUF_QUERY)]],
    const device T* latent_cache [[buffer(MLA_BUF_LATENT_CACHE)]],
    const device int* block_tables [[buffer(MLA_BUF_BLOCK_TABLES)]],
    const device int* seq_lens [[buffer(MLA_BUF_SEQ_LENS)]],
    const device int* cu_seqlens_q [[buffer(MLA_BUF_CU_SEQLENS_Q)]],
    device T* out [[buffer(MLA_BUF_OUT)]],
    constant MlaAttentionParams& p [[buffer(MLA_BUF_PARAMS)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint num_threads [[threads_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  static_assert(D % VM_SIMD_WIDTH == 0 && DV % VM_SIMD_WIDTH == 0 && DV <= D,
                "latent and value dims: multiples of the SIMD width, value_dim <= latent_dim");
  constexpr int KEYS = vm_mla_keys(sizeof(T), D);
  constexpr int QL = D / VM_SIMD_WIDTH;   // query columns per lane
  constexpr int VL = DV / VM_SIMD_WIDTH;  // output columns per lane
  threadgroup T tile[KEYS * D];
  threadgroup long row_base[KEYS];

  const int t = int(tg.y);
  const int h = int(tg.x) * (int(num_threads) / VM_SIMD_WIDTH) + int(sg);
  const bool head_live = h < p.num_heads;
  if (t >= p.num_tokens) {
    return;
  }
  device T* out_row = out + (long(t) * p.num_heads + h) * DV;

  // The token's sequence: the last s with cu_seqlens_q[s] <= t.
  int lo = 0;
  int hi = p.num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu_seqlens_q[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int s = lo;
  if (p.num_seqs == 0 || cu_seqlens_q[s] > t || t >= cu_seqlens_q[s + 1]) {
    // Batch padding (uniform per threadgroup: no barrier has been passed).
    if (head_live) {
      for (int c = 0; c < VL; ++c) {
        out_row[int(lane) + c * VM_SIMD_WIDTH] = T(0.0f);
      }
    }
    return;
  }
  const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
  const int pos = seq_lens[s] - q_len + (t - cu_seqlens_q[s]);
  const int n_keys = clamp(pos + 1, 0, p.max_blocks_per_seq * p.block_size);

  float q[QL];
  for (int i = 0; i < QL; ++i) {
    const long at = long(t) * p.q_stride_token + long(h) * p.q_stride_head + int(lane) +
                    i * VM_SIMD_WIDTH;
    q[i] = head_live ? float(query[at]) : 0.0f;
  }
  float o[VL];
  for (int c = 0; c < VL; ++c) {
    o[c] = 0.0f;
  }
  float m = -INFINITY;
  float l = 0.0f;

  const device int* table = block_tables + long(s) * p.max_blocks_per_seq;
  for (int k0 = 0; k0 < n_keys; k0 += KEYS) {
    // 1. Pool offsets of the tile's rows.
    if (int(tid) < KEYS) {
      const int k = k0 + int(tid);
      long base = -1;
      if (k < n_keys) {
        const int block = table[k / p.block_size];
        if (block >= 0 && block < p.num_blocks) {
          base = long(block) * p.cache_stride_block + long(k % p.block_size) * p.cache_stride_slot;
        }
      }
      row_base[tid] = base;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 2. Stage the rows (consecutive threads, consecutive columns).
    for (int i = int(tid); i < KEYS * D; i += int(num_threads)) {
      const int r = i / D;
      const long base = row_base[r];
      tile[i] = base >= 0 ? latent_cache[base + (i - r * D)] : T(0.0f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. Logits of the tile, then one online-softmax step.
    if (head_live) {
      float logit[KEYS];
      float tile_max = -INFINITY;
      for (int j = 0; j < KEYS; ++j) {
        float acc = 0.0f;
        for (int i = 0; i < QL; ++i) {
          acc += q[i] * float(tile[j * D + int(lane) + i * VM_SIMD_WIDTH]);
        }
        acc = simd_sum(acc) * p.scale;
        logit[j] = k0 + j < n_keys ? acc : -INFINITY;
        tile_max = max(tile_max, logit[j]);
      }
      const float m_new = max(m, tile_max);  // finite: key k0 is attended
      const float factor = metal::exp(m - m_new);
      l *= factor;
      for (int c = 0; c < VL; ++c) {
        o[c] *= factor;
      }
      for (int j = 0; j < KEYS; ++j) {
        const float w = metal::exp(logit[j] - m_new);
        l += w;
        for (int c = 0; c < VL; ++c) {
          o[c] += w * float(tile[j * D + int(lane) + c * VM_SIMD_WIDTH]);
        }
      }
      m = m_new;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile is rewritten next
  }

  if (head_live) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int c = 0; c < VL; ++c) {
      out_row[int(lane) + c * VM_SIMD_WIDTH] = T(o[c] * inv);
    }
  }
}

// Instances: VM_MLA_INSTANCES of constants.h.
#define MLA_INSTANTIATE(DT, T, BYTES, D, DV)                                                 \
  template [[host_name(VM_KERNEL_NAME_MLA(DT, D, DV))]] [[kernel]]                           \
  decltype(mla_attention<T, D, DV>) mla_attention<T, D, DV>;

VM_MLA_INSTANCES(MLA_INSTANTIATE)
