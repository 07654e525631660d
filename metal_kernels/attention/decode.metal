// Paged attention for decode rows (one query token per sequence), with optional split-KV.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], uint3 [[threadgroup_position_in_grid]], uint [[thread_index_in_simdgroup]],
// uint [[simdgroup_index_in_threadgroup]], uint [[thread_index_in_threadgroup]], in-body
// `threadgroup float x[N]` arrays, threadgroup_barrier(mem_flags::mem_threadgroup),
// simd_shuffle_xor, simd_max, simd_sum, vec<T, 4> loads from device memory (8/16-byte aligned),
// metal::exp / tanh / max / min, float2, half, bfloat, static_assert.
//
// paged_attention_decode_<dt>[_fp8]_d<D>_b<KB>: grid (Hq, rows, partitions), VM_DECODE_THREADS
//   threads (4 simdgroups); the kernel block is the block divisor, KB keys. Threadgroup (h, r,
//   part) computes query head h of work row r over one key partition. The four simdgroups take the
//   partition's kernel blocks of KB keys round-robin. Inside a simdgroup, 8 lanes share one key
//   (each lane holds 4 columns per 32-column round), so 4 keys are scored per pass with a 3-step
//   xor reduction and each key row is read as contiguous 64/128-byte segments. Online softmax runs
//   once per kernel block (one rescale per KB keys). The simdgroups' (m, l, o) are merged through
//   threadgroup memory at the end.
// paged_attention_reduce_<dt>_d<D>: grid (Hq, rows), VM_DECODE_THREADS threads. Merges the
//   partitions of rows that have more than one; rows with one partition were written directly by
//   the main kernel.

#include "common.h"

#define DEC_THREADS VM_DECODE_THREADS
#define DEC_SIMDGROUPS (DEC_THREADS / VM_SIMD_WIDTH)
#define DEC_LANES_PER_KEY 8
#define DEC_KEYS_PER_PASS (32 / DEC_LANES_PER_KEY)

// Key range [begin, end) of partition `part` of work row r; false if the partition is empty.
inline bool dec_partition_range(
    int lo, int hi, int r, int part, const device int* part_offsets,
    constant PagedAttentionParams& p, thread int& begin, thread int& end,
    thread bool& split) {
  split = false;
  if (p.partition_size > 0) {
    const int n_parts = part_offsets[r + 1] - part_offsets[r];
    if (part >= n_parts) {
      return false;
    }
    const int base = lo - lo % VM_PARTITION_ALIGN;
    begin = metal::max(lo, base + part * p.partition_size);
    end = metal::min(hi, base + (part + 1) * p.partition_size);
    split = n_parts > 1;
  } else {
    if (part > 0) {
      return false;
    }
    begin = lo;
    end = hi;
  }
  return true;
}

template <typename T, typename KV, int D, int KB>
[[kernel]] void paged_attention_decode(
    PA_KERNEL_BUFFERS(T, KV),
    PA_SPLIT_BUFFERS,
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(KB % DEC_KEYS_PER_PASS == 0, "kernel block must be a multiple of 4 keys");
  constexpr int ROUNDS = (D + 31) / 32;  // 32 columns per round: 8 lanes x 4
  constexpr int PASSES = KB / DEC_KEYS_PER_PASS;

  threadgroup float sg_m[DEC_SIMDGROUPS];
  threadgroup float sg_l[DEC_SIMDGROUPS];
  threadgroup float sg_o[DEC_SIMDGROUPS * D];

  const int h = int(tg_pos.x);
  const int r = int(tg_pos.y);
  const int part = int(tg_pos.z);
  if (r >= p.num_work) {
    return;
  }
  const int s = work[r];
  const int seq_len = seq_lens[s];
  const int token = cu_seqlens_q[s + 1] - 1;
  const int q_pos = seq_len - 1;
  const int lo = pa_window_start(q_pos, p);
  const int hi = seq_len;
  int begin = 0, end = 0;
  bool split = false;
  if (!dec_partition_range(lo, hi, r, part, part_offsets, p, begin, end, split)) {
    return;  // uniform for the whole threadgroup
  }

  const int group = p.num_q_heads / p.num_kv_heads;
  const int kvh = h / group;
  const int key_slot = int(lane) / DEC_LANES_PER_KEY;  // which of the pass's 4 keys
  const int sub = int(lane) % DEC_LANES_PER_KEY;       // 4-column chunk within a round

  // The lane's query columns, in float.
  float q[ROUNDS][4];
  float o[ROUNDS][4];
  const device T* q_row = query + long_t(token) * p.q_stride_token + long_t(h) * p.q_stride_head;
  for (int rd = 0; rd < ROUNDS; ++rd) {
    for (int e = 0; e < 4; ++e) {
      const int c = rd * 32 + sub * 4 + e;
      q[rd][e] = c < D ? float(q_row[c]) : 0.0f;
      o[rd][e] = 0.0f;
    }
  }

  float m = PA_NEG_INF;  // uniform across the simdgroup
  float l = 0.0f;        // sum over this lane's key slot
  const device int* block_table = block_tables + long_t(s) * p.max_blocks_per_seq;
  const long_t head_off = long_t(kvh) * p.kv_stride_head;
  const int first_block = begin - begin % KB;

  for (int b0 = first_block + int(sg) * KB; b0 < end; b0 += DEC_SIMDGROUPS * KB) {
    const long_t base = pa_token_offset(block_table, b0, p);  // KB divides block_size
    float score[PASSES];
    float block_max = PA_NEG_INF;
    for (int ps = 0; ps < PASSES; ++ps) {
      const int j = ps * DEC_KEYS_PER_PASS + key_slot;
      const int pos = b0 + j;
      const bool valid = pos >= begin && pos < end;
      float dot = 0.0f;
      if (valid && base >= 0) {
        const device KV* k_row = key_cache + base + long_t(j) * p.kv_stride_slot + head_off;
        const float k_scale = PaKv<T, KV>::row_scale(k_row, p.k_scale, p);
        const float k_zero = PaKv<T, KV>::row_zero(k_row, p);
        for (int rd = 0; rd < ROUNDS; ++rd) {
          const int c = rd * 32 + sub * 4;
          if (c < D) {
            const vec<T, 4> k4 = PaKv<T, KV>::load4(k_row, c, k_scale, k_zero, p.kv_format);
            dot += q[rd][0] * float(k4[0]) + q[rd][1] * float(k4[1]) + q[rd][2] * float(k4[2]) +
                   q[rd][3] * float(k4[3]);
          }
        }
      }
      // Reduce over the 8 lanes of this key (lanes 8k .. 8k+7).
      dot += simd_shuffle_xor(dot, ushort(1));
      dot += simd_shuffle_xor(dot, ushort(2));
      dot += simd_shuffle_xor(dot, ushort(4));
      score[ps] = valid ? pa_logit(dot, p) : PA_NEG_INF;
      block_max = metal::max(block_max, score[ps]);
    }
    block_max = simd_max(block_max);
    const float m_new = metal::max(m, block_max);
    const float shift = m_new == PA_NEG_INF ? 0.0f : m_new;
    const float factor = metal::exp(m - shift);
    l *= factor;
    for (int rd = 0; rd < ROUNDS; ++rd) {
      for (int e = 0; e < 4; ++e) {
        o[rd][e] *= factor;
      }
    }
    m = m_new;
    for (int ps = 0; ps < PASSES; ++ps) {
      const int j = ps * DEC_KEYS_PER_PASS + key_slot;
      const int pos = b0 + j;
      if (pos >= begin && pos < end) {
        const float w = metal::exp(score[ps] - shift);
        l += w;
        if (base >= 0) {
          const device KV* v_row = value_cache + base + long_t(j) * p.kv_stride_slot + head_off;
          const float v_scale = PaKv<T, KV>::row_scale(v_row, p.v_scale, p);
          const float v_zero = PaKv<T, KV>::row_zero(v_row, p);
          for (int rd = 0; rd < ROUNDS; ++rd) {
            const int c = rd * 32 + sub * 4;
            if (c < D) {
              const vec<T, 4> v4 = PaKv<T, KV>::load4(v_row, c, v_scale, v_zero, p.kv_format);
              for (int e = 0; e < 4; ++e) {
                o[rd][e] += w * float(v4[e]);
              }
            }
          }
        }
      }
    }
  }

  // Merge the 4 key slots of the simdgroup (lanes with equal `sub`), then the simdgroups.
  l += simd_shuffle_xor(l, ushort(8));
  l += simd_shuffle_xor(l, ushort(16));
  for (int rd = 0; rd < ROUNDS; ++rd) {
    for (int e = 0; e < 4; ++e) {
      o[rd][e] += simd_shuffle_xor(o[rd][e], ushort(8));
      o[rd][e] += simd_shuffle_xor(o[rd][e], ushort(16));
    }
  }
  if (lane == 0) {
    sg_m[sg] = m;
    sg_l[sg] = l;
  }
  if (key_slot == 0) {
    for (int rd = 0; rd < ROUNDS; ++rd) {
      for (int e = 0; e < 4; ++e) {
        const int c = rd * 32 + sub * 4 + e;
        if (c < D) {
          sg_o[int(sg) * D + c] = o[rd][e];
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  float m_all = PA_NEG_INF;
  for (int i = 0; i < DEC_SIMDGROUPS; ++i) {
    m_all = metal::max(m_all, sg_m[i]);
  }
  const float shift = m_all == PA_NEG_INF ? 0.0f : m_all;
  float weight[DEC_SIMDGROUPS];
  float l_all = 0.0f;
  for (int i = 0; i < DEC_SIMDGROUPS; ++i) {
    weight[i] = metal::exp(sg_m[i] - shift);
    l_all += weight[i] * sg_l[i];
  }

  if (split) {
    const int row = (part_offsets[r] + part) * p.scratch_heads + pa_scratch_row(h, p);
    if (tid == 0) {
      partial_ml[row] = float2(m_all, l_all);
    }
    for (int c = int(tid); c < D; c += DEC_THREADS) {
      float acc = 0.0f;
      for (int i = 0; i < DEC_SIMDGROUPS; ++i) {
        acc += weight[i] * sg_o[i * D + c];
      }
      partial_out[long_t(row) * D + c] = acc;
    }
    return;
  }
  if (p.has_sinks) {
    l_all += metal::exp(sinks[h] - shift);
  }
  const float inv = l_all > 0.0f ? 1.0f / l_all : 0.0f;
  device T* out_row = out + (long_t(token) * p.num_q_heads + h) * D;
  for (int c = int(tid); c < D; c += DEC_THREADS) {
    float acc = 0.0f;
    for (int i = 0; i < DEC_SIMDGROUPS; ++i) {
      acc += weight[i] * sg_o[i * D + c];
    }
    out_row[c] = T(acc * inv);
  }
}

template <typename T, int D>
[[kernel]] void paged_attention_reduce(
    const device int* cu_seqlens_q [[buffer(PA_BUF_CU_SEQLENS_Q)]],
    const device float* sinks [[buffer(PA_BUF_SINKS)]],
    device T* out [[buffer(PA_BUF_OUT)]],
    const device int* work [[buffer(PA_BUF_WORK)]],
    const device int* part_offsets [[buffer(PA_BUF_PART_OFFSETS)]],
    const device float2* partial_ml [[buffer(PA_BUF_PARTIAL_ML)]],
    const device float* partial_out [[buffer(PA_BUF_PARTIAL_OUT)]],
    constant PagedAttentionParams& p [[buffer(PA_BUF_PARAMS)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  constexpr int COLS = (D + DEC_THREADS - 1) / DEC_THREADS;
  threadgroup float red_max[DEC_SIMDGROUPS];
  threadgroup float red_sum[DEC_SIMDGROUPS];
  threadgroup float weights[DEC_THREADS];

  const int h = int(tg_pos.x);
  const int r = int(tg_pos.y);
  if (r >= p.num_work) {
    return;
  }
  const int first = part_offsets[r];
  const int n_parts = part_offsets[r + 1] - first;
  if (n_parts <= 1) {
    return;  // written by the main kernel
  }
  const int s = work[r];
  const int token = cu_seqlens_q[s + 1] - 1;
  const int head_row = pa_scratch_row(h, p);

  float m = PA_NEG_INF;
  for (int i = int(tid); i < n_parts; i += DEC_THREADS) {
    m = metal::max(m, partial_ml[(first + i) * p.scratch_heads + head_row].x);
  }
  m = simd_max(m);
  if (lane == 0) {
    red_max[sg] = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  m = red_max[0];
  for (int i = 1; i < DEC_SIMDGROUPS; ++i) {
    m = metal::max(m, red_max[i]);
  }
  const float shift = m == PA_NEG_INF ? 0.0f : m;

  float acc[COLS];
  for (int k = 0; k < COLS; ++k) {
    acc[k] = 0.0f;
  }
  float l = 0.0f;
  for (int c0 = 0; c0 < n_parts; c0 += DEC_THREADS) {
    const int i = c0 + int(tid);
    float w = 0.0f;
    if (i < n_parts) {
      const float2 ml = partial_ml[(first + i) * p.scratch_heads + head_row];
      w = metal::exp(ml.x - shift);
      l += w * ml.y;
    }
    weights[tid] = w;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int count = metal::min(DEC_THREADS, n_parts - c0);
    for (int j = 0; j < count; ++j) {
      const float wj = weights[j];
      const device float* src =
          partial_out + (long_t(first + c0 + j) * p.scratch_heads + head_row) * D;
      for (int k = 0; k < COLS; ++k) {
        const int c = int(tid) + k * DEC_THREADS;
        if (c < D) {
          acc[k] += wj * src[c];
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // before `weights` is rewritten
  }
  l = simd_sum(l);
  if (lane == 0) {
    red_sum[sg] = l;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  l = 0.0f;
  for (int i = 0; i < DEC_SIMDGROUPS; ++i) {
    l += red_sum[i];
  }
  if (p.has_sinks) {
    l += metal::exp(sinks[h] - shift);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  device T* out_row = out + (long_t(token) * p.num_q_heads + h) * D;
  for (int k = 0; k < COLS; ++k) {
    const int c = int(tid) + k * DEC_THREADS;
    if (c < D) {
      out_row[c] = T(acc[k] * inv);
    }
  }
}

// Instances: VM_DECODE_INSTANCES (pools of the query's type, and fp8 pools) and
// VM_REDUCE_INSTANCES of constants.h.
#define PA_INSTANTIATE_DECODE(DT, T, BYTES, D, B)                                            \
  template [[host_name(VM_KERNEL_NAME_DECODE(DT, D, B))]] [[kernel]]                         \
  decltype(paged_attention_decode<T, T, D, B>) paged_attention_decode<T, T, D, B>;
#define PA_INSTANTIATE_DECODE_FP8(DT, T, BYTES, D, B)                                        \
  template [[host_name(VM_KERNEL_NAME_DECODE_FP8(DT, D, B))]] [[kernel]]                     \
  decltype(paged_attention_decode<T, uchar, D, B>) paged_attention_decode<T, uchar, D, B>;
#define PA_INSTANTIATE_REDUCE(DT, T, BYTES, D)                                               \
  template [[host_name(VM_KERNEL_NAME_REDUCE(DT, D))]] [[kernel]]                            \
  decltype(paged_attention_reduce<T, D>) paged_attention_reduce<T, D>;

VM_DECODE_INSTANCES(PA_INSTANTIATE_DECODE)
VM_DECODE_INSTANCES(PA_INSTANTIATE_DECODE_FP8)
VM_REDUCE_INSTANCES(PA_INSTANTIATE_REDUCE)
