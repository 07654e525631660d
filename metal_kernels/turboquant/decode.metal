// Paged attention over TurboQuant pools for rows that read every key and value from the cache
// (decode rows, short continuation and verification chunks), at the pools' stored width: a key
// reads as centroid[index] * |k| (renormalized with norm correction) or as its fp8 bytes, a value
// as index * scale + min (common/turboquant.h); the queries arrive rotated into the keys' space
// (float32), the output is float32.
//
// MSL features used: function templates + [[host_name]] instantiation (decltype form),
// [[kernel]], [[buffer(n)]], `constant` struct reference, `device` pointers, uint3
// [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]], simd_sum, metal::exp,
// metal::tanh, metal::precise::sqrt / divide, float2, half, as_type.
//
// turboquant_decode_d<D>: grid (tokens, KV heads x head_chunks, num_partitions), one simdgroup
// (32 threads) a threadgroup. Threadgroup (t, y, z) scores query row t (its sequence: work[t], -1
// for padding) for up to VM_TQ_GROUP_HEADS query heads of KV head y / head_chunks (GQA: each key
// is unpacked once for all of them), over the keys of partition z of the row's range (its window
// and causal limit), partition_size keys each (0: one pass over all). Lane i holds elements
// [i * D / 32, (i + 1) * D / 32) of the query rows, the key and value being read and the
// outputs; dot products are simd_sum reductions; the softmax runs online per head.
// One pass: the threadgroup adds the sinks and writes `out`. Split-KV: it writes its (max, sum)
// and unnormalized output to the partial buffers (row (t * Hq + h) * num_partitions + z), and
// turboquant_reduce_d<D> (grid (tokens, Hq), 32 threads) merges a row's partitions and sinks.
// Rows of no sequence, and rows with neither keys nor sinks, are written as zeros.

#include <metal_stdlib>

#include "common/fp8.h"
#include "common/turboquant.h"
#include "constants.h"
#include "ops/turboquant/params.h"

using namespace metal;

#define TQ_NEG_INF (-INFINITY)

// The buffers both kernels bind (the slots of ops/turboquant/params.h).
#define TQ_BUFFERS                                                     \
  const device float* query [[buffer(TQA_BUF_QUERY)]],                 \
  const device uchar* key_cache [[buffer(TQA_BUF_KEY_CACHE)]],         \
  const device uchar* value_cache [[buffer(TQA_BUF_VALUE_CACHE)]],     \
  const device int* block_tables [[buffer(TQA_BUF_BLOCK_TABLES)]],     \
  const device int* seq_lens [[buffer(TQA_BUF_SEQ_LENS)]],             \
  const device int* cu_seqlens_q [[buffer(TQA_BUF_CU_SEQLENS_Q)]],     \
  const device float* sinks [[buffer(TQA_BUF_SINKS)]],                 \
  const device float* centroids [[buffer(TQA_BUF_CENTROIDS)]],         \
  device float* out [[buffer(TQA_BUF_OUT)]],                           \
  const device int* work [[buffer(TQA_BUF_WORK)]],                     \
  device float2* partial_ml [[buffer(TQA_BUF_PARTIAL_ML)]],            \
  device float* partial_out [[buffer(TQA_BUF_PARTIAL_OUT)]],           \
  constant TurboQuantAttentionParams& p [[buffer(TQA_BUF_PARAMS)]]

// Scaled logit with the optional softcap c * tanh(x / c).
inline float tq_logit(float dot, constant TurboQuantAttentionParams& p) {
  float x = dot * p.scale;
  if (p.softcap > 0.0f) {
    x = p.softcap * metal::tanh(x / p.softcap);
  }
  return x;
}

template <int D>
[[kernel]] void turboquant_decode(
    TQ_BUFFERS,
    uint3 tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_threadgroup]]) {
  constexpr int DL = D / 32;
  constexpr int GH = VM_TQ_GROUP_HEADS;
  const int token = int(tg.x);
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kvh = int(tg.y) / p.head_chunks;
  const int h0 = kvh * group + (int(tg.y) % p.head_chunks) * GH;
  const int nh = metal::min(GH, kvh * group + group - h0);
  const int seq = work[token];
  const int d0 = int(lane) * DL;

  // The row's keys [lo, hi): its window and causal limit, then this partition's share.
  int lo = 0;
  int hi = 0;
  if (seq >= 0) {
    const int q_start = cu_seqlens_q[seq];
    const int q_len = cu_seqlens_q[seq + 1] - q_start;
    const int ctx = seq_lens[seq];
    const int pos = ctx - q_len + (token - q_start);
    const int cap = metal::clamp(ctx, 0, p.max_blocks_per_seq * p.block_size);
    hi = metal::clamp(pos + 1, 0, cap);
    lo = metal::min(p.sliding_window > 0 ? metal::max(0, pos - p.sliding_window + 1) : 0, hi);
  }
  if (p.partition_size > 0) {
    const int first = metal::min(lo + int(tg.z) * p.partition_size, hi);
    hi = metal::min(hi, first + p.partition_size);
    lo = first;
  }

  float q[GH][DL];
  float acc[GH][DL];
  float m[GH];
  float l[GH];
  for (int g = 0; g < GH; ++g) {
    const long base = (long(token) * p.num_q_heads + h0 + g) * D + d0;
    for (int i = 0; i < DL; ++i) {
      q[g][i] = g < nh ? query[base + i] : 0.0f;
      acc[g][i] = 0.0f;
    }
    m[g] = TQ_NEG_INF;
    l[g] = 0.0f;
  }

  const device int* table = block_tables + long(metal::max(seq, 0)) * p.max_blocks_per_seq;
  for (int pos = lo; pos < hi; ++pos) {
    const int block = table[pos / p.block_size];
    const bool mapped = block >= 0 && block < p.num_blocks;  // the same for every lane
    const long slot = long(pos % p.block_size);
    float k[DL];
    float v[DL];
    float factor = 0.0f;
    if (mapped) {
      const device uchar* krow = key_cache + long(block) * p.kc_stride_block +
                                 slot * p.kc_stride_slot + long(kvh) * p.kc_stride_head;
      const device uchar* vrow = value_cache + long(block) * p.vc_stride_block +
                                 slot * p.vc_stride_slot + long(kvh) * p.vc_stride_head;
      if (p.key_bits == 8) {
        for (int i = 0; i < DL; ++i) {
          k[i] = vm_fp8_to_float(uint(krow[d0 + i]), VM_TQ_FP8_KEY_FORMAT);
        }
        factor = 1.0f;
      } else {
        float csq = 0.0f;
        for (int i = 0; i < DL; ++i) {
          k[i] = centroids[vm_tq_index(krow, d0 + i, p.key_bits)];
          csq += k[i] * k[i];
        }
        csq = simd_sum(csq);
        const int nb = vm_tq_packed_bytes(D, p.key_bits);
        factor = vm_tq_f16(uint(krow[nb]), uint(krow[nb + 1]));
        if (p.norm_correction != 0) {
          factor = metal::precise::divide(factor, metal::precise::sqrt(csq + VM_TQ_CENTROID_EPS));
        }
      }
      const float vscale = vm_tq_row_scale(vrow, D, p.value_bits);
      const float vmin = vm_tq_row_min(vrow, D, p.value_bits);
      for (int i = 0; i < DL; ++i) {
        v[i] = vm_tq_dequant(vm_tq_index(vrow, d0 + i, p.value_bits), vscale, vmin);
      }
    } else {
      for (int i = 0; i < DL; ++i) {
        k[i] = 0.0f;
        v[i] = 0.0f;
      }
    }
    for (int g = 0; g < nh; ++g) {
      float dot = 0.0f;
      for (int i = 0; i < DL; ++i) {
        dot += q[g][i] * k[i];
      }
      const float x = tq_logit(simd_sum(dot) * factor, p);
      const float m_new = metal::max(m[g], x);
      const float alpha = metal::exp(m[g] - m_new);
      const float w = metal::exp(x - m_new);
      l[g] = l[g] * alpha + w;
      for (int i = 0; i < DL; ++i) {
        acc[g][i] = acc[g][i] * alpha + w * v[i];
      }
      m[g] = m_new;
    }
  }

  for (int g = 0; g < nh; ++g) {
    const int h = h0 + g;
    const long row = long(token) * p.num_q_heads + h;
    if (p.partition_size > 0) {
      const long prow = row * p.num_partitions + int(tg.z);
      if (lane == 0) {
        partial_ml[prow] = float2(m[g], l[g]);
      }
      for (int i = 0; i < DL; ++i) {
        partial_out[prow * D + d0 + i] = acc[g][i];
      }
      continue;
    }
    float mx = m[g];
    if (p.has_sinks != 0 && seq >= 0) {
      mx = metal::max(mx, sinks[h]);
    }
    float inv = 0.0f;
    float keep = 0.0f;
    if (mx != TQ_NEG_INF) {
      keep = m[g] == TQ_NEG_INF ? 0.0f : metal::exp(m[g] - mx);
      float total = l[g] * keep;
      if (p.has_sinks != 0) {
        total += metal::exp(sinks[h] - mx);
      }
      inv = total > 0.0f ? metal::precise::divide(1.0f, total) : 0.0f;
    }
    for (int i = 0; i < DL; ++i) {
      out[row * D + d0 + i] = acc[g][i] * keep * inv;
    }
  }
}

template <int D>
[[kernel]] void turboquant_reduce(
    TQ_BUFFERS,
    uint3 tg [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_threadgroup]]) {
  constexpr int DL = D / 32;
  const int token = int(tg.x);
  const int h = int(tg.y);
  const long row = long(token) * p.num_q_heads + h;
  const int d0 = int(lane) * DL;
  float acc[DL];
  for (int i = 0; i < DL; ++i) {
    acc[i] = 0.0f;
  }
  float inv = 0.0f;
  if (work[token] >= 0) {
    float mx = p.has_sinks != 0 ? sinks[h] : TQ_NEG_INF;
    for (int z = 0; z < p.num_partitions; ++z) {
      mx = metal::max(mx, partial_ml[row * p.num_partitions + z].x);
    }
    if (mx != TQ_NEG_INF) {
      float total = p.has_sinks != 0 ? metal::exp(sinks[h] - mx) : 0.0f;
      for (int z = 0; z < p.num_partitions; ++z) {
        const float2 ml = partial_ml[row * p.num_partitions + z];
        if (ml.x == TQ_NEG_INF) {
          continue;
        }
        const float w = metal::exp(ml.x - mx);
        total += w * ml.y;
        const long base = (row * p.num_partitions + z) * D + d0;
        for (int i = 0; i < DL; ++i) {
          acc[i] += w * partial_out[base + i];
        }
      }
      inv = total > 0.0f ? metal::precise::divide(1.0f, total) : 0.0f;
    }
  }
  for (int i = 0; i < DL; ++i) {
    out[row * D + d0 + i] = acc[i] * inv;
  }
}

// Instances: VM_TQ_HEAD_SIZES of constants.h.
#define TQ_INSTANTIATE(D, ...)                                                       \
  template [[host_name(VM_KERNEL_NAME_TQ_DECODE(D))]] [[kernel]]                     \
  decltype(turboquant_decode<D>) turboquant_decode<D>;                               \
  template [[host_name(VM_KERNEL_NAME_TQ_REDUCE(D))]] [[kernel]]                     \
  decltype(turboquant_reduce<D>) turboquant_reduce<D>;

VM_TQ_HEAD_SIZES(TQ_INSTANTIATE, )
