// Tiled (FlashAttention-style) paged attention for rows with several query tokens.
//
// MSL features used: templates + [[host_name]] instantiation (decltype form), [[kernel]],
// [[buffer(n)]], uint3 [[threadgroup_position_in_grid]], uint [[thread_index_in_simdgroup]],
// uint [[simdgroup_index_in_threadgroup]], uint [[thread_index_in_threadgroup]], in-body
// `threadgroup T x[N]` arrays, threadgroup_barrier(mem_flags::mem_threadgroup),
// simdgroup_barrier(mem_flags::mem_threadgroup), simdgroup_matrix<T, 8, 8> /
// simdgroup_matrix<float, 8, 8>, make_filled_simdgroup_matrix, simdgroup_load / simdgroup_store
// (threadgroup pointers, elements_per_row, origin (0, 0), transpose flag), simdgroup_multiply,
// simdgroup_multiply_accumulate with T x T + float -> float, thread_elements() (float -> T),
// simd_shuffle_xor, vec<T, 4> device loads, metal::exp / tanh, half, bfloat, static_assert.
//
// paged_attention_prefill_<dt>[_fp8]_d<D>_b<B>: grid (tiles, Hkv * D / DV), vm_prefill_threads(BQ)
//   = BQ * 4 threads. The tile of BQ rows and KB keys is vm_prefill_rows/keys(B) (constants.h: the
//   first of VM_PREFILL_TILES with KB <= B whose arrays fit threadgroup memory).
//   The rows of sequence s for KV head g are its q_len tokens x the G query heads of g, ordered
//   token-major (row = i * G + j is token i, head g * G + j), so GQA heads share every K/V tile.
//   A work entry (s, tile) owns rows [tile * BQ, tile * BQ + BQ); simdgroup w owns 8 of them and
//   keeps its output rows [8, DV] in simdgroup matrices. DV = vm_value_columns(D): D, or 256 for
//   D = 512, where the two column halves of V/O are separate threadgroups (grid y = 2 * Hkv) that
//   both read all of Q and K. Per KV tile of KB keys: stage K, V (zero rows outside the tile's key
//   range) -> barrier -> S = Q K^T per simdgroup -> softmax of the simdgroup's rows (4 lanes per
//   row, causal + window masks) -> O = diag(f) O + P V -> barrier. Mixed batches work: a decode
//   row is just a sequence with q_len = 1. Work entries: PaWorkRows (common.h).

#include "common.h"

template <typename T, typename KV, int D, int B>
[[kernel]] void paged_attention_prefill(
    PA_KERNEL_BUFFERS(T, KV),
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint tid [[thread_index_in_threadgroup]]) {
  constexpr int BQ = vm_prefill_rows(sizeof(T), D, B);
  constexpr int KB = vm_prefill_keys(sizeof(T), D, B);
  constexpr int THREADS = vm_prefill_threads(BQ);
  constexpr int NSG = THREADS / VM_SIMD_WIDTH;
  constexpr int DV = vm_value_columns(D);
  constexpr int HALVES = D / DV;
  constexpr int PAD = 16 / sizeof(T);
  constexpr int QP = D + PAD;
  constexpr int VP = DV + PAD;
  constexpr int SP = KB + 4;
  constexpr int PP = KB + PAD;
  constexpr int O_TILES = DV / 8;
  static_assert(D % 16 == 0 && BQ % 8 == 0 && KB % 8 == 0 && KB > 0 && KB <= 32,
                "unsupported tile");

  threadgroup T q_tile[BQ * QP];
  threadgroup T k_tile[KB * QP];
  threadgroup T v_tile[KB * VP];
  threadgroup float s_tile[BQ * SP];
  threadgroup T p_tile[BQ * PP];
  threadgroup float diag[NSG * 64];
  // The host's model of these arrays (constants.h) must be exact: it picks the tile by it.
  static_assert(sizeof(q_tile) + sizeof(k_tile) + sizeof(v_tile) + sizeof(s_tile) +
                        sizeof(p_tile) + sizeof(diag) ==
                    vm_prefill_threadgroup_bytes(sizeof(T), D, BQ, KB),
                "threadgroup memory");

  const PaWorkRows w = pa_work_rows(work, cu_seqlens_q, seq_lens, tg_pos, BQ, DV, HALVES, p);
  if (w.row0 >= w.n_rows) {
    return;
  }
  pa_stage_query<T, BQ, D, THREADS>(q_tile, QP, query, w, p, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Softmax state of row `my_row` (lanes 4r .. 4r+3 of the simdgroup share row r).
  const int srow = int(lane) / 4;
  const int scol = int(lane) % 4;
  const int my_row = w.row0 + int(sg) * 8 + srow;
  const bool row_valid = my_row < w.n_rows;
  const int row_pos = w.ctx0 + my_row / w.group;
  const int row_lo = pa_window_start(row_pos, p);
  const int row_hi = row_valid ? row_pos + 1 : row_lo;  // attended keys: row_lo .. row_pos
  float m_run = PA_NEG_INF;
  float l_run = 0.0f;

  simdgroup_matrix<float, 8, 8> o_acc[O_TILES];
  for (int t = 0; t < O_TILES; ++t) {
    o_acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  const device int* block_table = block_tables + long_t(w.seq) * p.max_blocks_per_seq;
  const long_t head_off = long_t(w.kvh) * p.kv_stride_head;
  threadgroup const T* q_mine = q_tile + int(sg) * 8 * QP;
  threadgroup float* s_mine = s_tile + int(sg) * 8 * SP;
  threadgroup T* p_mine = p_tile + int(sg) * 8 * PP;
  threadgroup float* diag_mine = diag + int(sg) * 64;

  for (int b0 = w.tile_lo - w.tile_lo % KB; b0 < w.tile_hi; b0 += KB) {
    const long_t base = pa_token_offset(block_table, b0, p);
    pa_stage_kv<T, KV, KB, D, THREADS>(k_tile, QP, key_cache + head_off, 0, p.k_scale, base, b0,
                                       w.tile_lo, w.tile_hi, p, tid);
    pa_stage_kv<T, KV, KB, DV, THREADS>(v_tile, VP, value_cache + head_off, w.v_col0,
                                        p.v_scale,
                                        base, b0, w.tile_lo, w.tile_hi, p, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // S = Q K^T for this simdgroup's 8 rows.
    simdgroup_matrix<float, 8, 8> sacc[KB / 8];
    for (int n = 0; n < KB / 8; ++n) {
      sacc[n] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (int k = 0; k < D / 8; ++k) {
      simdgroup_matrix<T, 8, 8> a;
      simdgroup_load(a, q_mine + k * 8, QP);
      for (int n = 0; n < KB / 8; ++n) {
        simdgroup_matrix<T, 8, 8> b;
        simdgroup_load(b, k_tile + n * 8 * QP + k * 8, QP, ulong2(0, 0), true);
        simdgroup_multiply_accumulate(sacc[n], a, b, sacc[n]);
      }
    }
    for (int n = 0; n < KB / 8; ++n) {
      simdgroup_store(sacc[n], s_mine + n * 8, SP);
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // Online softmax of the simdgroup's rows (causal and window masks).
    const float f = pa_softmax_tile<T, KB, 4>(s_mine + srow * SP, p_mine + srow * PP, scol, b0,
                                              row_lo, row_hi, p, m_run, l_run);
    pa_diag_row(diag_mine, srow, scol, f);
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // O = diag(f) O + P V.
    simdgroup_matrix<float, 8, 8> fm;
    simdgroup_load(fm, diag_mine, 8);
    for (int t = 0; t < O_TILES; ++t) {
      simdgroup_multiply(o_acc[t], fm, o_acc[t]);
    }
    for (int k = 0; k < KB / 8; ++k) {
      simdgroup_matrix<T, 8, 8> pm;
      simdgroup_load(pm, p_mine + k * 8, PP);
      for (int t = 0; t < O_TILES; ++t) {
        simdgroup_matrix<T, 8, 8> vm;
        simdgroup_load(vm, v_tile + k * 8 * VP + t * 8, VP);
        simdgroup_multiply_accumulate(o_acc[t], pm, vm, o_acc[t]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // tiles are rewritten next
  }

  // Normalise (sinks join the denominator), convert, stage in this simdgroup's Q rows, store.
  float l_fin = l_run;
  if (p.has_sinks && row_valid) {
    const float shift = m_run == PA_NEG_INF ? 0.0f : m_run;
    l_fin += metal::exp(sinks[pa_row_head(w, my_row)] - shift);
  }
  const float inv = l_fin > 0.0f ? 1.0f / l_fin : 0.0f;
  pa_diag_row(diag_mine, srow, scol, inv);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<float, 8, 8> inv_m;
  simdgroup_load(inv_m, diag_mine, 8);
  threadgroup T* o_stage = q_tile + int(sg) * 8 * QP;  // only this simdgroup read these rows
  for (int t = 0; t < O_TILES; ++t) {
    simdgroup_multiply(o_acc[t], inv_m, o_acc[t]);
    simdgroup_matrix<T, 8, 8> o_t;
    o_t.thread_elements()[0] = T(o_acc[t].thread_elements()[0]);
    o_t.thread_elements()[1] = T(o_acc[t].thread_elements()[1]);
    simdgroup_store(o_t, o_stage + t * 8, QP);
  }
  simdgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(lane); i < 8 * DV; i += 32) {
    const int r = i / DV;
    const int c = i - r * DV;
    const int row = w.row0 + int(sg) * 8 + r;
    if (row < w.n_rows) {
      out[pa_out_index(w, row, c, D, p)] = o_stage[r * QP + c];
    }
  }
}

// Instances: VM_PREFILL_INSTANCES of constants.h, with pools of the query's type and fp8 pools.
#define PA_INSTANTIATE_PREFILL(DT, T, BYTES, D, B)                                           \
  template [[host_name(VM_KERNEL_NAME_PREFILL(DT, D, B))]] [[kernel]]                        \
  decltype(paged_attention_prefill<T, T, D, B>) paged_attention_prefill<T, T, D, B>;
#define PA_INSTANTIATE_PREFILL_FP8(DT, T, BYTES, D, B)                                       \
  template [[host_name(VM_KERNEL_NAME_PREFILL_FP8(DT, D, B))]] [[kernel]]                    \
  decltype(paged_attention_prefill<T, uchar, D, B>) paged_attention_prefill<T, uchar, D, B>;

VM_PREFILL_INSTANCES(PA_INSTANTIATE_PREFILL)
VM_PREFILL_INSTANCES(PA_INSTANTIATE_PREFILL_FP8)
