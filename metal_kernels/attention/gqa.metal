// GQA/MQA decode: one threadgroup reads each KV block once for the query heads sharing it.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], uint3 [[threadgroup_position_in_grid]], uint [[thread_index_in_simdgroup]],
// uint [[simdgroup_index_in_threadgroup]], uint [[thread_index_in_threadgroup]], in-body
// `threadgroup T x[N]` arrays, threadgroup_barrier(mem_flags::mem_threadgroup),
// simdgroup_matrix<T, 8, 8> / simdgroup_matrix<float, 8, 8>, make_filled_simdgroup_matrix,
// simdgroup_load / simdgroup_store (threadgroup and device pointers, elements_per_row,
// origin (0, 0), transpose flag), simdgroup_multiply, simdgroup_multiply_accumulate with
// T x T + float -> float, simdgroup_matrix::thread_elements() (float -> T conversion),
// simd_shuffle_xor, vec<T, 4> device loads, metal::exp / tanh, half, bfloat, static_assert.
//
// paged_attention_gqa_<dt>[_fp8]_d<D>_b<B>: grid (Hkv * ceil(G / 8), rows, partitions),
//   VM_GQA_THREADS threads, KB = vm_gqa_keys(B) keys per kernel block (the largest block divisor
//   <= B whose tiles fit threadgroup memory). A threadgroup owns VM_GQA_ROWS (8) query heads of
//   one KV head (G = Hq / Hkv; the last group is padded with zero query rows) for one decode row
//   and one key partition. Per kernel block of KB keys:
//     1. all threads stage K [KB, D] in threadgroup memory (zero rows past the range);
//     2. simdgroup j < KB / 8 computes S[:, 8j .. 8j+8) = Q K^T with 8x8 simdgroup matrices;
//     3. all threads stage V in the same buffer while simdgroup 0 runs the online softmax on
//        S (4 lanes per head row) and writes P and diag(exp(m_old - m_new));
//     4. simdgroup j owns output column tiles j, j+4, ...: O = diag(f) O + P V.
//   The rescale by a diagonal matrix keeps the code independent of the simdgroup-matrix element
//   layout. Row pitches carry 16 bytes of padding so 8x8 loads of consecutive rows do not hit the
//   same threadgroup memory banks.

#include "common.h"

#define GQA_THREADS VM_GQA_THREADS
#define GQA_SIMDGROUPS (GQA_THREADS / VM_SIMD_WIDTH)
#define GQA_ROWS VM_GQA_ROWS

template <typename T, typename KV, int D, int B>
[[kernel]] void paged_attention_gqa(
    PA_KERNEL_BUFFERS(T, KV),
    PA_SPLIT_BUFFERS,
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  constexpr int KB = vm_gqa_keys(sizeof(T), D, B);
  static_assert(D % 16 == 0 && KB % 8 == 0 && KB > 0 && KB <= 32, "unsupported tile");
  constexpr int PAD = 16 / sizeof(T);
  constexpr int QP = D + PAD;    // pitch of Q and K/V rows (elements of T)
  constexpr int SP = KB + 4;     // pitch of S rows (float)
  constexpr int PP = KB + PAD;   // pitch of P rows (T)
  constexpr int COL_TILES = D / 8;
  constexpr int MY_TILES = (COL_TILES + GQA_SIMDGROUPS - 1) / GQA_SIMDGROUPS;

  threadgroup T q_tile[GQA_ROWS * QP];
  threadgroup T kv_tile[KB * QP];
  threadgroup float s_tile[GQA_ROWS * SP];
  threadgroup T p_tile[GQA_ROWS * PP];
  threadgroup float diag[64];
  // The host's model of these arrays (constants.h) must be exact: it picks KB by it.
  static_assert(sizeof(q_tile) + sizeof(kv_tile) + sizeof(s_tile) + sizeof(p_tile) +
                        sizeof(diag) ==
                    vm_gqa_threadgroup_bytes(sizeof(T), D, KB),
                "threadgroup memory");

  const int group = p.num_q_heads / p.num_kv_heads;
  const int row_tiles = (group + GQA_ROWS - 1) / GQA_ROWS;
  const int kvh = int(tg_pos.x) / row_tiles;
  const int rt = int(tg_pos.x) % row_tiles;
  const int h0 = kvh * group + rt * GQA_ROWS;
  const int n_heads = metal::min(GQA_ROWS, group - rt * GQA_ROWS);
  const int r = int(tg_pos.y);
  const int part = int(tg_pos.z);
  if (r >= p.num_work) {
    return;
  }
  const int s = work[r];
  const int seq_len = seq_lens[s];
  const int token = cu_seqlens_q[s + 1] - 1;
  const int lo = pa_window_start(seq_len - 1, p);
  const int hi = seq_len;
  int begin = lo, end = hi;
  bool split = false;
  if (p.partition_size > 0) {
    const int n_parts = part_offsets[r + 1] - part_offsets[r];
    if (part >= n_parts) {
      return;
    }
    const int base = lo - lo % VM_PARTITION_ALIGN;
    begin = metal::max(lo, base + part * p.partition_size);
    end = metal::min(hi, base + (part + 1) * p.partition_size);
    split = n_parts > 1;
  } else if (part > 0) {
    return;
  }

  // Stage the 8 query rows (zeros for padding heads).
  for (int i = int(tid); i < GQA_ROWS * D; i += GQA_THREADS) {
    const int row = i / D;
    const int c = i - row * D;
    T v = T(0.0f);
    if (row < n_heads) {
      v = query[long_t(token) * p.q_stride_token + long_t(h0 + row) * p.q_stride_head + c];
    }
    q_tile[row * QP + c] = v;
  }

  simdgroup_matrix<float, 8, 8> o_acc[MY_TILES];
  for (int t = 0; t < MY_TILES; ++t) {
    o_acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  // Softmax state of head row lane / 4, held by the 4 lanes of that row in simdgroup 0.
  const int srow = int(lane) / 4;
  const int scol = int(lane) % 4;
  float m_run = PA_NEG_INF;
  float l_run = 0.0f;

  const device int* block_table = block_tables + long_t(s) * p.max_blocks_per_seq;
  const long_t head_off = long_t(kvh) * p.kv_stride_head;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int b0 = begin - begin % KB; b0 < end; b0 += KB) {
    const long_t base = pa_token_offset(block_table, b0, p);
    // 1. K tile.
    pa_stage_kv<T, KV, KB, D, GQA_THREADS>(kv_tile, QP, key_cache + head_off, 0, p.k_scale, base,
                                           b0, begin, end, p, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 2. S = Q K^T, one 8-key column tile per simdgroup.
    if (int(sg) < KB / 8) {
      simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int k = 0; k < D / 8; ++k) {
        simdgroup_matrix<T, 8, 8> a;
        simdgroup_matrix<T, 8, 8> b;
        simdgroup_load(a, q_tile + k * 8, QP);
        simdgroup_load(b, kv_tile + int(sg) * 8 * QP + k * 8, QP, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(acc, a, b, acc);
      }
      simdgroup_store(acc, s_tile + int(sg) * 8, SP);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. V tile (all threads) and online softmax (simdgroup 0).
    pa_stage_kv<T, KV, KB, D, GQA_THREADS>(kv_tile, QP, value_cache + head_off, 0, p.v_scale, base,
                                           b0, begin, end, p, tid);
    if (sg == 0) {
      const float f = pa_softmax_tile<T, KB, 4>(s_tile + srow * SP, p_tile + srow * PP, scol, b0,
                                                begin, end, p, m_run, l_run);
      pa_diag_row(diag, srow, scol, f);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 4. O = diag(f) O + P V on this simdgroup's column tiles.
    simdgroup_matrix<float, 8, 8> fm;
    simdgroup_load(fm, diag, 8);
    for (int t = 0; t < MY_TILES; ++t) {
      const int ct = int(sg) + t * GQA_SIMDGROUPS;
      if (ct < COL_TILES) {
        simdgroup_multiply(o_acc[t], fm, o_acc[t]);
        for (int k = 0; k < KB / 8; ++k) {
          simdgroup_matrix<T, 8, 8> pm;
          simdgroup_matrix<T, 8, 8> vm;
          simdgroup_load(pm, p_tile + k * 8, PP);
          simdgroup_load(vm, kv_tile + k * 8 * QP + ct * 8, QP);
          simdgroup_multiply_accumulate(o_acc[t], pm, vm, o_acc[t]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // kv_tile, p_tile, diag are rewritten next
  }

  if (split) {
    // Unnormalised O and (m, l) of this partition; the scratch keeps 8 rows per head group.
    const int first_row = (part_offsets[r] + part) * p.scratch_heads +
                          kvh * (p.scratch_heads / p.num_kv_heads) + rt * GQA_ROWS;
    if (sg == 0 && scol == 0) {
      partial_ml[first_row + srow] = float2(m_run, l_run);
    }
    for (int t = 0; t < MY_TILES; ++t) {
      const int ct = int(sg) + t * GQA_SIMDGROUPS;
      if (ct < COL_TILES) {
        simdgroup_store(o_acc[t], partial_out + long_t(first_row) * D + ct * 8, D);
      }
    }
    return;
  }

  if (sg == 0) {
    float l_fin = l_run;
    if (p.has_sinks && srow < n_heads) {
      const float shift = m_run == PA_NEG_INF ? 0.0f : m_run;
      l_fin += metal::exp(sinks[h0 + srow] - shift);
    }
    const float inv = l_fin > 0.0f ? 1.0f / l_fin : 0.0f;
    pa_diag_row(diag, srow, scol, inv);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<float, 8, 8> inv_m;
  simdgroup_load(inv_m, diag, 8);
  for (int t = 0; t < MY_TILES; ++t) {
    const int ct = int(sg) + t * GQA_SIMDGROUPS;
    if (ct < COL_TILES) {
      simdgroup_multiply(o_acc[t], inv_m, o_acc[t]);
      simdgroup_matrix<T, 8, 8> o_t;
      o_t.thread_elements()[0] = T(o_acc[t].thread_elements()[0]);
      o_t.thread_elements()[1] = T(o_acc[t].thread_elements()[1]);
      simdgroup_store(o_t, q_tile + ct * 8, QP);  // Q is no longer read
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(tid); i < n_heads * D; i += GQA_THREADS) {
    const int row = i / D;
    const int c = i - row * D;
    out[(long_t(token) * p.num_q_heads + h0 + row) * D + c] = q_tile[row * QP + c];
  }
}

// Instances: VM_DECODE_INSTANCES of constants.h, with pools of the query's type and fp8 pools.
#define PA_INSTANTIATE_GQA(DT, T, BYTES, D, B)                                               \
  template [[host_name(VM_KERNEL_NAME_GQA(DT, D, B))]] [[kernel]]                            \
  decltype(paged_attention_gqa<T, T, D, B>) paged_attention_gqa<T, T, D, B>;
#define PA_INSTANTIATE_GQA_FP8(DT, T, BYTES, D, B)                                           \
  template [[host_name(VM_KERNEL_NAME_GQA_FP8(DT, D, B))]] [[kernel]]                        \
  decltype(paged_attention_gqa<T, uchar, D, B>) paged_attention_gqa<T, uchar, D, B>;

VM_DECODE_INSTANCES(PA_INSTANTIATE_GQA)
VM_DECODE_INSTANCES(PA_INSTANTIATE_GQA_FP8)
