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
// paged_attention_prefill_<dt>_d<D>_b<B>: grid (tiles, Hkv * D / DV), vm_prefill_threads(BQ)
//   = BQ * 4 threads. The tile of BQ rows and KB keys is vm_prefill_rows/keys(B) (constants.h: the
//   first of VM_PREFILL_TILES with KB <= B whose arrays fit threadgroup memory).
//   The rows of sequence s for KV head g are its q_len tokens x the G query heads of g, ordered
//   token-major (row = i * G + j is token i, head g * G + j), so GQA heads share every K/V tile.
//   A work entry (s, tile) owns rows [tile * BQ, tile * BQ + BQ); simdgroup w owns 8 of them and
//   keeps its output rows [8, DV] in simdgroup matrices. DV = vm_value_columns(D): D, or 256 for
//   D = 512, where the two column halves of V/O are separate threadgroups (grid y = 2 * Hkv) that
//   both read all of Q and K. Per KV tile of KB keys: stage K, V (zero rows outside the tile's key range) ->
//   barrier -> S = Q K^T per simdgroup -> softmax of the simdgroup's rows (4 lanes per row,
//   causal + window masks) -> O = diag(f) O + P V -> barrier. Mixed batches work: a decode row
//   is just a sequence with q_len = 1.

#include "common.h"

template <typename T, int D, int B>
[[kernel]] void paged_attention_prefill(
    const device T* query [[buffer(PA_BUF_QUERY)]],
    const device T* key_cache [[buffer(PA_BUF_KEY_CACHE)]],
    const device T* value_cache [[buffer(PA_BUF_VALUE_CACHE)]],
    const device int* block_tables [[buffer(PA_BUF_BLOCK_TABLES)]],
    const device int* seq_lens [[buffer(PA_BUF_SEQ_LENS)]],
    const device int* cu_seqlens_q [[buffer(PA_BUF_CU_SEQLENS_Q)]],
    const device float* sinks [[buffer(PA_BUF_SINKS)]],
    device T* out [[buffer(PA_BUF_OUT)]],
    const device int* work [[buffer(PA_BUF_WORK)]],
    constant PagedAttentionParams& p [[buffer(PA_BUF_PARAMS)]],
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
  constexpr int D4 = D / 4;
  constexpr int DV4 = DV / 4;
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

  const int s = work[2 * tg_pos.x];
  const int tile = work[2 * tg_pos.x + 1];
  const int kvh = int(tg_pos.y) / HALVES;
  const int v_col0 = (int(tg_pos.y) % HALVES) * DV;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int q_start = cu_seqlens_q[s];
  const int q_len = cu_seqlens_q[s + 1] - q_start;
  const int seq_len = seq_lens[s];
  const int ctx0 = seq_len - q_len;  // position of the sequence's first query token
  const int n_rows = q_len * group;
  const int row0 = tile * BQ;
  if (row0 >= n_rows) {
    return;
  }
  const int last_row = metal::min(row0 + BQ, n_rows) - 1;
  // Key range of the whole tile: window start of its first token .. its last token.
  const int tile_lo = pa_window_start(ctx0 + row0 / group, p);
  const int tile_hi = ctx0 + last_row / group + 1;

  // Stage Q rows (zeros past the sequence's rows).
  for (int i = int(tid); i < BQ * D; i += THREADS) {
    const int m = i / D;
    const int c = i - m * D;
    const int row = row0 + m;
    T v = T(0.0f);
    if (row < n_rows) {
      const int tok = q_start + row / group;
      const int head = kvh * group + row % group;
      v = query[long_t(tok) * p.q_stride_token + long_t(head) * p.q_stride_head + c];
    }
    q_tile[m * QP + c] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Softmax state of row `my_row` (lanes 4r .. 4r+3 of the simdgroup share row r).
  const int srow = int(lane) / 4;
  const int scol = int(lane) % 4;
  const int my_row = row0 + int(sg) * 8 + srow;
  const bool row_valid = my_row < n_rows;
  const int row_pos = ctx0 + my_row / group;
  const int row_lo = pa_window_start(row_pos, p);
  const int row_hi = row_valid ? row_pos + 1 : row_lo;  // attended keys: row_lo .. row_pos
  float m_run = PA_NEG_INF;
  float l_run = 0.0f;

  simdgroup_matrix<float, 8, 8> o_acc[O_TILES];
  for (int t = 0; t < O_TILES; ++t) {
    o_acc[t] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  const device int* block_table = block_tables + long_t(s) * p.max_blocks_per_seq;
  const long_t head_off = long_t(kvh) * p.kv_stride_head;
  threadgroup const T* q_mine = q_tile + int(sg) * 8 * QP;
  threadgroup float* s_mine = s_tile + int(sg) * 8 * SP;
  threadgroup T* p_mine = p_tile + int(sg) * 8 * PP;
  threadgroup float* diag_mine = diag + int(sg) * 64;

  for (int b0 = tile_lo - tile_lo % KB; b0 < tile_hi; b0 += KB) {
    const long_t base = pa_token_offset(block_table, b0, p);
    for (int i = int(tid); i < KB * D4; i += THREADS) {
      const int j = i / D4;
      const int c = (i - j * D4) * 4;
      const int pos = b0 + j;
      vec<T, 4> v4 = vec<T, 4>(T(0.0f));
      if (base >= 0 && pos >= tile_lo && pos < tile_hi) {
        v4 = *reinterpret_cast<const device vec<T, 4>*>(
            key_cache + base + long_t(j) * p.kv_stride_slot + head_off + c);
      }
      *reinterpret_cast<threadgroup vec<T, 4>*>(k_tile + j * QP + c) = v4;
    }
    for (int i = int(tid); i < KB * DV4; i += THREADS) {
      const int j = i / DV4;
      const int c = (i - j * DV4) * 4;
      const int pos = b0 + j;
      vec<T, 4> v4 = vec<T, 4>(T(0.0f));
      if (base >= 0 && pos >= tile_lo && pos < tile_hi) {
        v4 = *reinterpret_cast<const device vec<T, 4>*>(
            value_cache + base + long_t(j) * p.kv_stride_slot + head_off + v_col0 + c);
      }
      *reinterpret_cast<threadgroup vec<T, 4>*>(v_tile + j * VP + c) = v4;
    }
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
    l_fin += metal::exp(sinks[kvh * group + my_row % group] - shift);
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
    const int row = row0 + int(sg) * 8 + r;
    if (row < n_rows) {
      const int tok = q_start + row / group;
      const int head = kvh * group + row % group;
      out[(long_t(tok) * p.num_q_heads + head) * D + v_col0 + c] = o_stage[r * QP + c];
    }
  }
}

// Instances: VM_PREFILL_INSTANCES of constants.h.
#define PA_INSTANTIATE_PREFILL(DT, T, BYTES, D, B)                                           \
  template [[host_name(VM_KERNEL_NAME_PREFILL(DT, D, B))]] [[kernel]]                        \
  decltype(paged_attention_prefill<T, D, B>) paged_attention_prefill<T, D, B>;

VM_PREFILL_INSTANCES(PA_INSTANTIATE_PREFILL)
