// What the paged-attention kernel families share: buffer parameters, KV addressing and element
// reads (pools of the query's type, fp8 bytes, or per-token-head rows), masks, the logit transform, prefill work
// entries, tile staging and the online-softmax step.
//
// MSL features used here: metal::tanh, metal::exp, metal::max/min, `constant` struct references,
// `device` pointers, `threadgroup` pointers and `thread` references as function parameters,
// simd_shuffle_xor, vec<T, 4> / uchar4 loads, static_cast between half / bfloat / float, class
// template partial specialisation, as_type. Compiled with -I csrc (constants.h, common/fp8.h,
// common/per_token_head.h, ops/attention/params.h).
#pragma once

#include <metal_stdlib>

#include "common/fp8.h"
#include "common/per_token_head.h"
#include "constants.h"
#include "ops/attention/params.h"

using namespace metal;

#define PA_NEG_INF (-INFINITY)

// Kernel parameters binding the slots of ops/attention/params.h that the main kernels of every
// family take (the split-KV scratch only for decode and gqa), declared once. KV: the pools'
// element type, T (the query's) or uchar (fp8 bytes).
#define PA_KERNEL_BUFFERS(T, KV)                                  \
  const device T* query [[buffer(PA_BUF_QUERY)]],                 \
  const device KV* key_cache [[buffer(PA_BUF_KEY_CACHE)]],        \
  const device KV* value_cache [[buffer(PA_BUF_VALUE_CACHE)]],    \
  const device int* block_tables [[buffer(PA_BUF_BLOCK_TABLES)]], \
  const device int* seq_lens [[buffer(PA_BUF_SEQ_LENS)]],         \
  const device int* cu_seqlens_q [[buffer(PA_BUF_CU_SEQLENS_Q)]], \
  const device float* sinks [[buffer(PA_BUF_SINKS)]],             \
  device T* out [[buffer(PA_BUF_OUT)]],                           \
  const device int* work [[buffer(PA_BUF_WORK)]],                 \
  constant PagedAttentionParams& p [[buffer(PA_BUF_PARAMS)]]
#define PA_SPLIT_BUFFERS                                          \
  const device int* part_offsets [[buffer(PA_BUF_PART_OFFSETS)]], \
  device float2* partial_ml [[buffer(PA_BUF_PARTIAL_ML)]],        \
  device float* partial_out [[buffer(PA_BUF_PARTIAL_OUT)]]

// Element offset of key position `pos` of a sequence (kv head applied by the caller), or -1 when
// the block table entry is out of range (the key then reads as zeros).
inline long_t pa_token_offset(
    const device int* block_table,  // this sequence's row of block_tables
    int pos,
    constant PagedAttentionParams& p) {
  const int block = block_table[pos / p.block_size];
  if (block < 0 || block >= p.num_blocks) {
    return -1;
  }
  return long_t(block) * p.kv_stride_block + long_t(pos % p.block_size) * p.kv_stride_slot;
}

// Four consecutive K/V elements (columns c .. c + 3 of the row `row`, its first element or byte)
// of a pool of KV elements as the kernels compute with them, in the query's type T: pools of T as
// stored; byte pools (KV = uchar) as value(byte) * scale rounded to T (the op's contract), the byte
// an fp8 one of format kv_format or a per-token-head element, or for int4 rows (level - zero) *
// scale with the level a nibble (common/per_token_head.h). `scale` is row_scale's: the row's
// factor; `zero` row_zero's: int4's zero point.
template <typename T, typename KV>
struct PaKv {
  static float row_scale(const device KV* row, float scale, constant PagedAttentionParams& p) {
    return scale;
  }
  static float row_zero(const device KV* row, constant PagedAttentionParams& p) { return 0.0f; }
  static vec<T, 4> load4(const device KV* row, int c, float scale, float zero, int kv_format) {
    return *reinterpret_cast<const device vec<T, 4>*>(row + c);
  }
};
template <typename T>
struct PaKv<T, uchar> {
  // A per-token-head row's stored scale: the float32 after its element bytes.
  static float stored_scale(const device uchar* row, constant PagedAttentionParams& p) {
    const device uchar* s = row + vm_pth_data_bytes(p.head_dim, p.kv_format);
    return vm_pth_scale(s[0], s[1], s[2], s[3]);
  }
  // The factor of one pool row: the per-tensor `scale` (p.k_scale for keys, p.v_scale for
  // values) of fp8 pools, or a per-token-head row's own scale (int4: its zero point cleared).
  static float row_scale(const device uchar* row, float scale, constant PagedAttentionParams& p) {
    if (!vm_pth_is(p.kv_format)) {
      return scale;
    }
    const float stored = stored_scale(row, p);
    return vm_pth_int4(p.kv_format) ? vm_pth_int4_scale(stored) : stored;
  }
  // The zero point of an int4 row (0 for every other format).
  static float row_zero(const device uchar* row, constant PagedAttentionParams& p) {
    return vm_pth_int4(p.kv_format) ? vm_pth_int4_zp(stored_scale(row, p)) : 0.0f;
  }
  static float value(uint code, int kv_format) {
    return vm_pth_is(kv_format) ? vm_pth_element(code, kv_format) : vm_fp8_to_float(code, kv_format);
  }
  static vec<T, 4> load4(const device uchar* row, int c, float scale, float zero, int kv_format) {
    if (vm_pth_int4(kv_format)) {  // c is a multiple of 4: two whole bytes
      const uint lo = row[c / 2], hi = row[c / 2 + 1];
      return vec<T, 4>(T(vm_pth_int4_value(vm_pth_int4_level(lo, 0), zero, scale)),
                       T(vm_pth_int4_value(vm_pth_int4_level(lo, 1), zero, scale)),
                       T(vm_pth_int4_value(vm_pth_int4_level(hi, 0), zero, scale)),
                       T(vm_pth_int4_value(vm_pth_int4_level(hi, 1), zero, scale)));
    }
    const uchar4 b = *reinterpret_cast<const device uchar4*>(row + c);
    return vec<T, 4>(T(value(b.x, kv_format) * scale), T(value(b.y, kv_format) * scale),
                     T(value(b.z, kv_format) * scale), T(value(b.w, kv_format) * scale));
  }
};

// Scaled logit with the optional softcap c * tanh(x / c).
inline float pa_logit(float dot, constant PagedAttentionParams& p) {
  float x = dot * p.scale;
  if (p.softcap > 0.0f) {
    x = p.softcap * metal::tanh(x / p.softcap);
  }
  return x;
}

// First key position attended by query position q_pos (inclusive).
inline int pa_window_start(int q_pos, constant PagedAttentionParams& p) {
  return p.sliding_window > 0 ? metal::max(0, q_pos - p.sliding_window + 1) : 0;
}

// One work entry of the prefill families (grid x: a (sequence, tile) pair of the work list; grid y:
// the KV head and, for wide heads, the value-column half). It owns rows [row0, row0 + rows) of
// the sequence's q_len x G (token, head) rows, token-major: row r is token r / G, head
// kvh * G + r % G.
struct PaWorkRows {
  int seq;
  int kvh;
  int v_col0;   // first value (and output) column of this threadgroup
  int group;    // G = Hq / Hkv
  int q_start;  // packed index of the sequence's first query token
  int ctx0;     // position of that token
  int n_rows;   // q_len * G; the entry is empty when row0 >= n_rows
  int row0;
  int tile_lo;  // keys the entry attends: [tile_lo, tile_hi)
  int tile_hi;
};

inline PaWorkRows pa_work_rows(
    const device int* work, const device int* cu_seqlens_q, const device int* seq_lens,
    uint3 tg_pos, int rows, int value_columns, int halves, constant PagedAttentionParams& p) {
  PaWorkRows w;
  w.seq = work[2 * tg_pos.x];
  const int tile = work[2 * tg_pos.x + 1];
  w.kvh = int(tg_pos.y) / halves;
  w.v_col0 = (int(tg_pos.y) % halves) * value_columns;
  w.group = p.num_q_heads / p.num_kv_heads;
  w.q_start = cu_seqlens_q[w.seq];
  const int q_len = cu_seqlens_q[w.seq + 1] - w.q_start;
  w.ctx0 = seq_lens[w.seq] - q_len;
  w.n_rows = q_len * w.group;
  w.row0 = tile * rows;
  const int last_row = metal::min(w.row0 + rows, w.n_rows) - 1;
  // Key range of the whole tile: window start of its first token .. its last token.
  w.tile_lo = pa_window_start(w.ctx0 + w.row0 / w.group, p);
  w.tile_hi = w.ctx0 + last_row / w.group + 1;
  return w;
}

inline int pa_row_token(thread const PaWorkRows& w, int row) { return w.q_start + row / w.group; }
inline int pa_row_head(thread const PaWorkRows& w, int row) {
  return w.kvh * w.group + row % w.group;
}

// Element of out [T, Hq, head_dim] for `row` of the entry and column c of its value columns.
inline long_t pa_out_index(
    thread const PaWorkRows& w, int row, int c, int head_dim, constant PagedAttentionParams& p) {
  return (long_t(pa_row_token(w, row)) * p.num_q_heads + pa_row_head(w, row)) * head_dim +
         w.v_col0 + c;
}

// Stages the entry's ROWS query rows (zeros past its rows) into q_tile of row pitch `pitch`.
template <typename T, int ROWS, int D, int THREADS>
inline void pa_stage_query(
    threadgroup T* q_tile, int pitch, const device T* query, thread const PaWorkRows& w,
    constant PagedAttentionParams& p, uint tid) {
  for (int i = int(tid); i < ROWS * D; i += THREADS) {
    const int m = i / D;
    const int c = i - m * D;
    const int row = w.row0 + m;
    T v = T(0.0f);
    if (row < w.n_rows) {
      v = query[long_t(pa_row_token(w, row)) * p.q_stride_token +
                long_t(pa_row_head(w, row)) * p.q_stride_head + c];
    }
    q_tile[m * pitch + c] = v;
  }
}

// Stages the KB keys b0 .. b0 + KB - 1 of one KV head, columns col0 .. col0 + COLS - 1 of each,
// into a threadgroup tile of row pitch `pitch`, THREADS threads cooperating with 4-element
// vectors. `rows` points at the head's rows in the pool (their first element or byte), and `base`
// is the element offset of b0's slot (pa_token_offset; < 0 for an unmapped block). Keys outside
// [lo, hi) and unmapped ones read zero. Byte pools are dequantized here with `scale` or each row's
// own (PaKv::row_scale, row_zero), so the tile holds T as for any pool.
template <typename T, typename KV, int KB, int COLS, int THREADS>
inline void pa_stage_kv(
    threadgroup T* tile, int pitch, const device KV* rows, int col0, float scale, long_t base,
    int b0, int lo, int hi, constant PagedAttentionParams& p, uint tid) {
  constexpr int C4 = COLS / 4;
  for (int i = int(tid); i < KB * C4; i += THREADS) {
    const int j = i / C4;
    const int c = (i - j * C4) * 4;
    const int pos = b0 + j;
    vec<T, 4> v4 = vec<T, 4>(T(0.0f));
    if (base >= 0 && pos >= lo && pos < hi) {
      const device KV* row = rows + base + long_t(j) * p.kv_stride_slot;
      const float row_scale = PaKv<T, KV>::row_scale(row, scale, p);
      const float row_zero = PaKv<T, KV>::row_zero(row, p);
      v4 = PaKv<T, KV>::load4(row, col0 + c, row_scale, row_zero, p.kv_format);
    }
    *reinterpret_cast<threadgroup vec<T, 4>*>(tile + j * pitch + c) = v4;
  }
}

// One online-softmax step over a tile of KB scores for a row held by LANES lanes of a simdgroup
// (4 or 8; lane `col0` of the row owns columns col0, col0 + LANES, ...). Tile column c is key
// position b0 + c; keys outside [lo, hi) are masked. Folds the tile into the running
// (m_run, l_run), stores the probabilities as T in p_row and returns the factor that rescales the
// row's output.
template <typename T, int KB, int LANES>
inline float pa_softmax_tile(
    threadgroup const float* s_row, threadgroup T* p_row, int col0, int b0, int lo, int hi,
    constant PagedAttentionParams& p, thread float& m_run, thread float& l_run) {
  float x[KB / LANES];
  float mx = PA_NEG_INF;
  for (int t = 0; t < KB / LANES; ++t) {
    const int col = col0 + LANES * t;
    const int pos = b0 + col;
    x[t] = pos >= lo && pos < hi ? pa_logit(s_row[col], p) : PA_NEG_INF;
    mx = metal::max(mx, x[t]);
  }
  for (ushort m = 1; m < LANES; m *= 2) {
    mx = metal::max(mx, simd_shuffle_xor(mx, m));  // the row's max over its lanes
  }
  const float m_new = metal::max(m_run, mx);
  const float shift = m_new == PA_NEG_INF ? 0.0f : m_new;
  const float f = metal::exp(m_run - shift);
  float ls = 0.0f;
  for (int t = 0; t < KB / LANES; ++t) {
    const float w = metal::exp(x[t] - shift);
    ls += w;
    p_row[col0 + LANES * t] = T(w);
  }
  for (ushort m = 1; m < LANES; m *= 2) {
    ls += simd_shuffle_xor(ls, m);  // the row's sum over its lanes
  }
  l_run = l_run * f + ls;
  m_run = m_new;
  return f;
}

// Row `row` of an 8x8 float matrix diag(v), written by the 4 lanes of that row: lane col0 writes
// columns 2 * col0 and 2 * col0 + 1.
inline void pa_diag_row(threadgroup float* diag, int row, int col0, float v) {
  diag[row * 8 + 2 * col0] = (2 * col0 == row) ? v : 0.0f;
  diag[row * 8 + 2 * col0 + 1] = (2 * col0 + 1 == row) ? v : 0.0f;
}

// Row of the partial buffers for query head h: kv heads keep `scratch_heads / num_kv_heads` rows
// each, so a GQA threadgroup can store a padded group of 8 heads with one stride.
inline int pa_scratch_row(int h, constant PagedAttentionParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  const int rows_per_kv = p.scratch_heads / p.num_kv_heads;
  return (h / group) * rows_per_kv + (h % group);
}
