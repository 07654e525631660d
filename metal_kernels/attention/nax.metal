// Paged prefill attention on the neural accelerators of M5-class GPUs (Metal 4 tensor ops).
//
// Compiled only when the compiler offers Metal 4 tensors (__HAVE_TENSOR__: -std=metal4.0, macOS
// 26.2 SDK); otherwise this file instantiates nothing and the host never asks for its kernels
// (kernel_select needs the device's NAX flag, which also requires the kernels in the library).
//
// MSL features used (beyond paged_attention_prefill.metal): <metal_tensor>,
// <MetalPerformancePrimitives/MetalPerformancePrimitives.h>, and only this subset of them:
//   metal::tensor<threadgroup T, metal::dextents<int32_t, 2>, metal::tensor_inline>(ptr, extents,
//     strides) views of threadgroup arrays; extents are (columns, rows), strides {1, row_pitch};
//   mpp::tensor_ops::matmul2d_descriptor(M, N, K, transpose_left, transpose_right,
//     relaxed_precision = false, mode::multiply | mode::multiply_accumulate);
//   mpp::tensor_ops::matmul2d<desc, metal::execution_simdgroups<4>> with run(A, B, C), A and B
//     threadgroup tensors, C a threadgroup float tensor or a destination cooperative tensor;
//     called by all 128 threads of the threadgroup (bracketed by threadgroup barriers here);
//   op.get_destination_cooperative_tensor<A_t, B_t, E>() with get_capacity(), get_mask(i),
//     operator[](i), get_multidimensional_index(i) -> (column, row), store(threadgroup tensor).
//
// paged_attention_nax_<dt>[_fp8]_d<D>: grid (tiles, Hkv * D / DV), VM_NAX_THREADS (128) threads,
//   BQ = VM_NAX_ROWS (16) rows, KB = VM_NAX_KEYS (16) keys per tile (block_size % KB == 0).
//   Rows, work list and masks as in the tiled prefill kernel. D = 512 runs as two 256-column
//   halves: each threadgroup computes S over the full head dim in two K steps of 256 and
//   accumulates V/O for its half only, so Q + one K/V chunk fit the 32 KB of threadgroup memory.

#include <metal_stdlib>

#if defined(__HAVE_TENSOR__)
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#include <metal_tensor>

#include "common.h"

#define NAX_THREADS VM_NAX_THREADS

template <typename T, typename KV, int D>
[[kernel]] void paged_attention_nax(
    PA_KERNEL_BUFFERS(T, KV),
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  using namespace mpp::tensor_ops;
  using extents_t = metal::dextents<int32_t, 2>;
  using strides_t = metal::array<int32_t, 2>;
  using tg_tensor_t = metal::tensor<threadgroup T, extents_t, metal::tensor_inline>;
  using tg_ftensor_t = metal::tensor<threadgroup float, extents_t, metal::tensor_inline>;

  constexpr int BQ = VM_NAX_ROWS;
  constexpr int KB = VM_NAX_KEYS;
  constexpr int DK = vm_value_columns(D);  // head-dim chunk of one Q K^T step
  constexpr int K_STEPS = D / DK;
  constexpr int DV = DK;                 // output columns of one threadgroup
  constexpr int HALVES = D / DV;
  constexpr int PAD = 16 / sizeof(T);
  constexpr int QP = D + PAD;
  constexpr int KP = DK + PAD;
  constexpr int SP = KB + 4;
  constexpr int PP = KB + PAD;
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(
      (BQ * QP + KB * KP + BQ * PP) * sizeof(T) + (BQ * SP + BQ) * 4 <=
          VM_THREADGROUP_MEMORY_BYTES,
      "threadgroup memory");

  threadgroup T q_tile[BQ * QP];
  threadgroup T kv_tile[KB * KP];
  threadgroup float s_tile[BQ * SP];
  threadgroup T p_tile[BQ * PP];
  threadgroup float row_scale[BQ];

  const PaWorkRows w = pa_work_rows(work, cu_seqlens_q, seq_lens, tg_pos, BQ, DV, HALVES, p);
  if (w.row0 >= w.n_rows) {
    return;
  }
  pa_stage_query<T, BQ, D, NAX_THREADS>(q_tile, QP, query, w, p, tid);

  // Softmax lanes: 8 threads per row (all inside one simdgroup), 2 columns each.
  const int srow = int(tid) / 8;
  const int scol = int(tid) % 8;
  const int my_row = w.row0 + srow;
  const bool row_valid = my_row < w.n_rows;
  const int row_pos = w.ctx0 + my_row / w.group;
  const int row_lo = pa_window_start(row_pos, p);
  const int row_hi = row_valid ? row_pos + 1 : row_lo;  // attended keys: row_lo .. row_pos
  float m_run = PA_NEG_INF;
  float l_run = 0.0f;

  constexpr auto qk_desc = matmul2d_descriptor(
      BQ, KB, DK, false, true, false, matmul2d_descriptor::mode::multiply);
  constexpr auto qk_acc_desc = matmul2d_descriptor(
      BQ, KB, DK, false, true, false, matmul2d_descriptor::mode::multiply_accumulate);
  constexpr auto pv_desc = matmul2d_descriptor(
      BQ, DV, KB, false, false, false, matmul2d_descriptor::mode::multiply_accumulate);
  matmul2d<qk_desc, metal::execution_simdgroups<4>> qk_op;
  matmul2d<qk_acc_desc, metal::execution_simdgroups<4>> qk_acc_op;
  matmul2d<pv_desc, metal::execution_simdgroups<4>> pv_op;

  tg_tensor_t t_k(kv_tile, extents_t(DK, KB), strides_t{1, KP});
  tg_tensor_t t_v(kv_tile, extents_t(DV, KB), strides_t{1, KP});
  tg_ftensor_t t_s(s_tile, extents_t(KB, BQ), strides_t{1, SP});
  tg_tensor_t t_p(p_tile, extents_t(KB, BQ), strides_t{1, PP});

  auto o_acc = pv_op.template get_destination_cooperative_tensor<tg_tensor_t, tg_tensor_t, float>();
  for (uint16_t i = 0; i < o_acc.get_capacity(); ++i) {
    if (o_acc.get_mask(i)) {
      o_acc[i] = 0.0f;
    }
  }

  const device int* block_table = block_tables + long_t(w.seq) * p.max_blocks_per_seq;
  const long_t head_off = long_t(w.kvh) * p.kv_stride_head;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int b0 = w.tile_lo - w.tile_lo % KB; b0 < w.tile_hi; b0 += KB) {
    const long_t base = pa_token_offset(block_table, b0, p);
    for (int step = 0; step < K_STEPS; ++step) {
      pa_stage_kv<T, KV, KB, DK, NAX_THREADS>(kv_tile, KP, key_cache + head_off,
                                              step * DK, p.k_scale, base, b0, w.tile_lo, w.tile_hi, p, tid);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      tg_tensor_t t_q(q_tile + step * DK, extents_t(DK, BQ), strides_t{1, QP});
      if (step == 0) {
        qk_op.run(t_q, t_k, t_s);
      } else {
        qk_acc_op.run(t_q, t_k, t_s);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // V chunk for this threadgroup's columns, and the online softmax of S.
    pa_stage_kv<T, KV, KB, DV, NAX_THREADS>(kv_tile, KP, value_cache + head_off,
                                            w.v_col0, p.v_scale, base, b0, w.tile_lo, w.tile_hi, p, tid);
    const float f = pa_softmax_tile<T, KB, 8>(s_tile + srow * SP, p_tile + srow * PP, scol, b0,
                                              row_lo, row_hi, p, m_run, l_run);
    if (scol == 0) {
      row_scale[srow] = f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint16_t i = 0; i < o_acc.get_capacity(); ++i) {
      if (o_acc.get_mask(i)) {
        const auto idx = o_acc.get_multidimensional_index(i);
        o_acc[i] *= row_scale[idx[1]];
      }
    }
    pv_op.run(t_p, t_v, o_acc);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  float l_fin = l_run;
  if (p.has_sinks && row_valid) {
    const float shift = m_run == PA_NEG_INF ? 0.0f : m_run;
    l_fin += metal::exp(sinks[pa_row_head(w, my_row)] - shift);
  }
  if (scol == 0) {
    row_scale[srow] = l_fin > 0.0f ? 1.0f / l_fin : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  auto o_out = pv_op.template get_destination_cooperative_tensor<tg_tensor_t, tg_tensor_t, T>();
  for (uint16_t i = 0; i < o_acc.get_capacity(); ++i) {
    if (o_acc.get_mask(i)) {
      const auto idx = o_acc.get_multidimensional_index(i);
      o_out[i] = T(o_acc[i] * row_scale[idx[1]]);
    }
  }
  tg_tensor_t t_o(q_tile, extents_t(DV, BQ), strides_t{1, QP});  // Q is no longer read
  o_out.store(t_o);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int i = int(tid); i < BQ * DV; i += NAX_THREADS) {
    const int r = i / DV;
    const int c = i - r * DV;
    const int row = w.row0 + r;
    if (row < w.n_rows) {
      out[pa_out_index(w, row, c, D, p)] = q_tile[r * QP + c];
    }
  }
}

// Instances: VM_NAX_INSTANCES of constants.h, with pools of the query's type and fp8 pools.
#define PA_INSTANTIATE_NAX(DT, T, BYTES, D)                                                  \
  template [[host_name(VM_KERNEL_NAME_NAX(DT, D))]] [[kernel]]                               \
  decltype(paged_attention_nax<T, T, D>) paged_attention_nax<T, T, D>;
#define PA_INSTANTIATE_NAX_FP8(DT, T, BYTES, D)                                              \
  template [[host_name(VM_KERNEL_NAME_NAX_FP8(DT, D))]] [[kernel]]                           \
  decltype(paged_attention_nax<T, uchar, D>) paged_attention_nax<T, uchar, D>;

VM_NAX_INSTANCES(PA_INSTANTIATE_NAX)
VM_NAX_INSTANCES(PA_INSTANTIATE_NAX_FP8)

#endif  // __HAVE_TENSOR__
