// Inner CPU kernel of paged attention: one work item = some query tokens of one sequence and a
// range of KV heads, streamed over the keys in tiles with an online (running max / sum) softmax.
//
// Each key tile is widened to float32 once and used by every query head that reads it (GQA). The
// dot products and the P·V update use the vector helpers of cpu_simd.h at the width of the
// instruction set this object is compiled for.
//
// Compiled several times with different instruction-set flags (VM_ISA names the variant);
// everything except the exported run_item_<VM_ISA> has internal linkage, and no STL templates are
// used here, so the variants cannot leak instructions into one another through the linker's
// merging of inline code.

#include "ops/attention/cpu_kernel.h"
#include "ops/attention/cpu_fp8.h"
#include "ops/attention/cpu_simd.h"

#ifndef VM_ISA
#define VM_ISA generic
#endif
#define VM_CAT2(a, b) a##b
#define VM_CAT(a, b) VM_CAT2(a, b)

namespace vllm_metal::cpu {
namespace {

constexpr int TK = kKeyTile;

// p[r][j] = q[r] · k[j] for R query rows (stride D) and J keys at a time.
template <typename KV, int R, int J>
inline void qk_block(const float* __restrict q, const typename KV::T* const* k, int64_t koff,
                     int64_t D, float* __restrict p, int64_t j) {
  vf acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < J; ++b) acc[r][b] = vf{};
  const typename KV::T* kr[J];
  float kz[J];
  for (int b = 0; b < J; ++b) {
    kr[b] = k[j + b] + koff;
    kz[b] = KV::zero(kr[b], D);
  }
  int64_t d = 0;
  for (; d + VW <= D; d += VW) {
    vf kv[J];
    for (int b = 0; b < J; ++b) kv[b] = KV::vec(kr[b], d, kz[b]);
    for (int r = 0; r < R; ++r) {
      const vf qv = vload(q + r * D + d);
      for (int b = 0; b < J; ++b) acc[r][b] += qv * kv[b];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < J; ++b) {
      float s = hsum(acc[r][b]);
      for (int64_t e = d; e < D; ++e) s += q[r * D + e] * KV::load(kr[b], e, kz[b]);
      if constexpr (KV::per_row) s *= KV::row_scale(kr[b], D);
      p[r * TK + j + b] = s;
    }
  }
}

template <typename KV, int R>
inline void qk_rows(const float* q, const typename KV::T* const* k, int64_t koff, int64_t D,
                    float* p, int64_t j0, int64_t j1) {
  constexpr int J = R == 1 ? 8 : (R == 2 ? 4 : 2);
  int64_t j = j0;
  for (; j + J <= j1; j += J) qk_block<KV, R, J>(q, k, koff, D, p, j);
  for (; j < j1; ++j) qk_block<KV, R, 1>(q, k, koff, D, p, j);
}

// Scores of G query rows (one KV head) against keys [j0, j1) of the staged tile.
template <typename KV>
inline void qk_group(const float* q, int64_t G, const typename KV::T* const* k, int64_t koff,
                     int64_t D, float* p, int64_t j0, int64_t j1) {
  int64_t r = 0;
  for (; r + 4 <= G; r += 4) qk_rows<KV, 4>(q + r * D, k, koff, D, p + r * TK, j0, j1);
  switch (G - r) {
    case 3:
      qk_rows<KV, 3>(q + r * D, k, koff, D, p + r * TK, j0, j1);
      break;
    case 2:
      qk_rows<KV, 2>(q + r * D, k, koff, D, p + r * TK, j0, j1);
      break;
    case 1:
      qk_rows<KV, 1>(q + r * D, k, koff, D, p + r * TK, j0, j1);
      break;
    default:
      break;
  }
}

// o[r][d .. d + C*VW) += sum_j p[r][j] * v[j][d ..] for R rows.
template <typename KV, int R, int C>
inline void pv_block(float* __restrict o, const float* __restrict p,
                     const typename KV::T* const* v, int64_t voff, int64_t D, int64_t d,
                     int64_t j0, int64_t j1) {
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vload(o + r * D + d + c * VW);
  for (int64_t j = j0; j < j1; ++j) {
    const typename KV::T* vr = v[j] + voff;
    const float vz = KV::zero(vr, D);
    vf vv[C];
    for (int c = 0; c < C; ++c) vv[c] = KV::vec(vr, d + c * VW, vz);
    for (int r = 0; r < R; ++r) {
      const vf pr = vsplat(p[r * TK + j]);
      for (int c = 0; c < C; ++c) acc[r][c] += pr * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(o + r * D + d + c * VW, acc[r][c]);
}

template <typename KV, int R>
inline void pv_rows(float* o, const float* p, const typename KV::T* const* v, int64_t voff,
                    int64_t D, int64_t j0, int64_t j1) {
  constexpr int C = R == 1 ? 4 : 2;
  int64_t d = 0;
  for (; d + C * VW <= D; d += C * VW) pv_block<KV, R, C>(o, p, v, voff, D, d, j0, j1);
  for (; d + VW <= D; d += VW) pv_block<KV, R, 1>(o, p, v, voff, D, d, j0, j1);
  for (; d < D; ++d) {
    for (int r = 0; r < R; ++r) {
      float acc = o[r * D + d];
      for (int64_t j = j0; j < j1; ++j) {
        const typename KV::T* vr = v[j] + voff;
        acc += p[r * TK + j] * KV::load(vr, d, KV::zero(vr, D));
      }
      o[r * D + d] = acc;
    }
  }
}

template <typename KV>
inline void pv_group(float* o, int64_t G, const float* p, const typename KV::T* const* v,
                     int64_t voff, int64_t D, int64_t j0, int64_t j1) {
  int64_t r = 0;
  for (; r + 4 <= G; r += 4) pv_rows<KV, 4>(o + r * D, p + r * TK, v, voff, D, j0, j1);
  for (; r + 2 <= G; r += 2) pv_rows<KV, 2>(o + r * D, p + r * TK, v, voff, D, j0, j1);
  for (; r < G; ++r) pv_rows<KV, 1>(o + r * D, p + r * TK, v, voff, D, j0, j1);
}

// Pool rows of one key tile: rows[j] points at KV head kv_begin of key t0 + j (heads `pitch`
// elements apart: head_dim, or a per-token-head row's bytes).
template <typename T>
inline void tile_rows(const T* pool, int64_t stride_b, int64_t stride_o, int64_t kv_begin,
                      const int32_t* table, int64_t block_size, int64_t num_blocks, int64_t t0,
                      int64_t count, int64_t pitch, const T* zero, const T** rows) {
  for (int64_t j = 0; j < count; ++j) {
    const int64_t t = t0 + j;
    const int64_t block = table[t / block_size];
    // An invalid table entry reads zeros: memory-safe (the optional value checks report it).
    rows[j] = block < 0 || block >= num_blocks
                  ? zero
                  : pool + block * stride_b + (t % block_size) * stride_o + kv_begin * pitch;
  }
}

template <typename T>
inline void prefetch_tile(const T* pool, int64_t stride_b, int64_t stride_o,
                          int64_t kv_begin, int64_t nh, const int32_t* table, int64_t block_size,
                          int64_t num_blocks, int64_t t0, int64_t count, int64_t pitch) {
  const int64_t bytes = nh * pitch * static_cast<int64_t>(sizeof(*pool));
  for (int64_t j = 0; j < count; ++j) {
    const int64_t t = t0 + j;
    const int64_t block = table[t / block_size];
    if (block < 0 || block >= num_blocks) continue;
    const char* src = reinterpret_cast<const char*>(
        pool + block * stride_b + (t % block_size) * stride_o + kv_begin * pitch);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(src + b);
  }
}

template <ElemType E, KvFormat F>
void run_item(const AttentionArgs& a, const WorkItem& w, const Scratch& sc, float* partial_o,
              float* partial_ml) {
  using T = typename Elem<E>::T;
  using KV = KvElem<E, F>;
  using KT = typename KV::T;
  constexpr bool fp8 = F != KvFormat::same && !KV::per_row;  // per-tensor k_scale / v_scale
  // fp8 pools hold unscaled values: k_scale joins the query scale, v_scale the probabilities.
  const float q_scale = fp8 ? a.scale * a.k_scale : a.scale;
  const int64_t D = a.head_dim;
  const int64_t pitch = a.kv_row;  // pool elements from one KV head's row to the next
  const int64_t G = a.num_q_heads / a.num_kv_heads;
  const int64_t nq = w.q_end - w.q_begin;
  const int64_t nh = w.kv_end - w.kv_begin;
  const int64_t rows_per_token = nh * G;
  const int64_t M = nq * rows_per_token;
  const int64_t W = a.sliding_window;
  const int64_t tok0 = w.q_begin;
  const float neg_inf = -__builtin_inff();

  // Key range of each query token, clipped to this item's key range.
  int64_t k_lo = w.k_end, k_hi = w.k_begin;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t p = w.pos_begin + i;
    const int64_t lo = max64(W > 0 ? p - W + 1 : 0, w.k_begin);
    const int64_t hi = max64(min64(p + 1, w.k_end), lo);
    sc.token_lo[i] = static_cast<int32_t>(lo);
    sc.token_hi[i] = static_cast<int32_t>(hi);
    if (lo < hi) {
      k_lo = min64(k_lo, lo);
      k_hi = max64(k_hi, hi);
    }
  }

  // Scaled float32 queries.
  const T* q_base = static_cast<const T*>(a.query);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t hk = 0; hk < nh; ++hk) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = (w.kv_begin + hk) * G + g;
        const T* src = q_base + (tok0 + i) * a.q_stride_t + h * a.q_stride_h;
        float* dst = sc.q + ((i * nh + hk) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = Elem<E>::load(src[d * a.q_stride_d]) * q_scale;
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    sc.m[r] = neg_inf;
    sc.l[r] = 0.0f;
  }
  for (int64_t x = 0; x < M * D; ++x) sc.o[x] = 0.0f;

  const KT* kc = static_cast<const KT*>(a.key_cache);
  const KT* vc = static_cast<const KT*>(a.value_cache);
  const int32_t* table = a.block_tables + w.seq * a.max_blocks;
  const KT* zero = reinterpret_cast<const KT*>(sc.zero);  // zero floats are zero bytes: +0.0
  const KT* krows[TK];
  const KT* vrows[TK];

  for (int64_t t0 = k_lo; t0 < k_hi; t0 += TK) {
    const int64_t count = min64(TK, k_hi - t0);
    tile_rows<KT>(kc, a.kc_stride_b, a.kc_stride_o, w.kv_begin, table, a.block_size, a.num_blocks,
                 t0, count, pitch, zero, krows);
    tile_rows<KT>(vc, a.vc_stride_b, a.vc_stride_o, w.kv_begin, table, a.block_size, a.num_blocks,
                 t0, count, pitch, zero, vrows);
    // Keys stream from memory: request this tile's values and the next tile's keys now.
    prefetch_tile<KT>(vc, a.vc_stride_b, a.vc_stride_o, w.kv_begin, nh, table, a.block_size,
                     a.num_blocks, t0, count, pitch);
    if (t0 + TK < k_hi) {
      prefetch_tile<KT>(kc, a.kc_stride_b, a.kc_stride_o, w.kv_begin, nh, table, a.block_size,
                       a.num_blocks, t0 + TK, min64(TK, k_hi - t0 - TK), pitch);
    }

    // Token by token: scores, online softmax, then P.V for that token's rows (rows of different
    // tokens are independent, so the order across tokens does not change any result).
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t j0 = max64(t0, sc.token_lo[i]) - t0;
      const int64_t j1 = min64(t0 + count, sc.token_hi[i]) - t0;
      if (j0 >= j1) continue;
      for (int64_t hk = 0; hk < nh; ++hk) {
        const int64_t r0 = (i * nh + hk) * G;
        qk_group<KV>(sc.q + r0 * D, G, krows, hk * pitch, D, sc.p + r0 * TK, j0, j1);
      }
      for (int64_t r = i * rows_per_token; r < (i + 1) * rows_per_token; ++r) {
        float* pr = sc.p + r * TK;
        if (a.softcap > 0.0f) softcap_row(pr + j0, j1 - j0, a.softcap);
        float tile_max = pr[j0];
        for (int64_t j = j0 + 1; j < j1; ++j) tile_max = pr[j] > tile_max ? pr[j] : tile_max;
        const float m_old = sc.m[r];
        const float m_new = tile_max > m_old ? tile_max : m_old;
        float sum = 0.0f;
        int64_t j = j0;
        const vf mv = vsplat(m_new);
        vf vsum = vf{};
        for (; j + VW <= j1; j += VW) {
          const vf e = vexp(vload(pr + j) - mv);
          vstore(pr + j, e);
          vsum += e;
        }
        for (; j < j1; ++j) {
          pr[j] = exp1(pr[j] - m_new);
          sum += pr[j];
        }
        for (int u = 0; u < VW; ++u) sum += vsum[u];
        const float alpha = exp1(m_old - m_new);
        sc.l[r] = sc.l[r] * alpha + sum;
        sc.m[r] = m_new;
        if (alpha != 1.0f) {
          float* orow = sc.o + r * D;
          for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        }
        if (fp8 && a.v_scale != 1.0f) {  // after the sum: only the values are scaled
          for (int64_t jj = j0; jj < j1; ++jj) pr[jj] *= a.v_scale;
        }
        if constexpr (KV::per_row) {  // each value row by its own scale
          const int64_t voff = (r - i * rows_per_token) / G * pitch;
          for (int64_t jj = j0; jj < j1; ++jj) pr[jj] *= KV::row_scale(vrows[jj] + voff, D);
        }
      }
      for (int64_t hk = 0; hk < nh; ++hk) {
        const int64_t r0 = (i * nh + hk) * G;
        pv_group<KV>(sc.o + r0 * D, G, sc.p + r0 * TK, vrows, hk * pitch, D, j0, j1);
      }
    }
  }

  if (w.partial >= 0) {
    for (int64_t x = 0; x < M * D; ++x) partial_o[x] = sc.o[x];
    for (int64_t r = 0; r < M; ++r) {
      partial_ml[2 * r] = sc.m[r];
      partial_ml[2 * r + 1] = sc.l[r];
    }
    return;
  }

  T* out = static_cast<T*>(a.out);
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t hk = 0; hk < nh; ++hk) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (i * nh + hk) * G + g;
        const int64_t h = (w.kv_begin + hk) * G + g;
        float* orow = sc.o + r * D;
        float l = sc.l[r];
        if (a.sinks != nullptr) {
          // The sink is one more logit with a zero value: it only enlarges the denominator.
          const float sink = a.sinks[h];
          const float m_old = sc.m[r];
          const float m_new = sink > m_old ? sink : m_old;
          const float alpha = exp1(m_old - m_new);
          l = l * alpha + exp1(sink - m_new);
          for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        T* dst = out + ((tok0 + i) * a.num_q_heads + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = Elem<E>::store(orow[d] * inv);
      }
    }
  }
}

}  // namespace

namespace {

template <KvFormat F>
void run_item_as(const AttentionArgs& a, const WorkItem& w, const Scratch& sc, float* partial_o,
                 float* partial_ml) {
  switch (a.dtype) {
    case ElemType::f32:
      return run_item<ElemType::f32, F>(a, w, sc, partial_o, partial_ml);
    case ElemType::f16:
      return run_item<ElemType::f16, F>(a, w, sc, partial_o, partial_ml);
    case ElemType::bf16:
      return run_item<ElemType::bf16, F>(a, w, sc, partial_o, partial_ml);
  }
}

}  // namespace

void VM_CAT(run_item_, VM_ISA)(const AttentionArgs& a, const WorkItem& w, const Scratch& sc,
                               float* partial_o, float* partial_ml) {
  switch (a.kv_format) {
    case KvFormat::same:
      return run_item_as<KvFormat::same>(a, w, sc, partial_o, partial_ml);
    case KvFormat::fp8_e4m3:
      return run_item_as<KvFormat::fp8_e4m3>(a, w, sc, partial_o, partial_ml);
    case KvFormat::fp8_e5m2:
      return run_item_as<KvFormat::fp8_e5m2>(a, w, sc, partial_o, partial_ml);
    case KvFormat::int8_per_token_head:
      return run_item_as<KvFormat::int8_per_token_head>(a, w, sc, partial_o, partial_ml);
    case KvFormat::fp8_per_token_head:
      return run_item_as<KvFormat::fp8_per_token_head>(a, w, sc, partial_o, partial_ml);
    case KvFormat::int4_per_token_head:
      return run_item_as<KvFormat::int4_per_token_head>(a, w, sc, partial_o, partial_ml);
  }
}

}  // namespace vllm_metal::cpu
