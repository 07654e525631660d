// Writes each step token's key and value rows into its slot of the TurboQuant pools, as
// common/turboquant.h stores them: fp8 keys, or the centroid indices of the rotated unit key (the
// rotation and the norm come from MLX) packed with its float16 norm; values packed with their
// float16 scale and min.
//
// MSL features used: [[kernel]], [[buffer(n)]], `constant` struct reference, `device` pointers
// (long slot ids), uint [[threadgroup_position_in_grid]], uint [[thread_index_in_threadgroup]],
// uint [[threads_per_threadgroup]], float / uchar, metal::precise::divide, metal::floor, half,
// as_type, function templates over address-space-qualified pointers.
//
// Grid: one thread per (token, KV head) row (row = token * Hkv + head), threadgroups of 32
// threads (select_turboquant_write_kernel). A negative slot (padding) or one >= num_slots skips
// the row. Rows write disjoint bytes, so no thread waits for another.

#include <metal_stdlib>

#include "common/fp8.h"
#include "common/turboquant.h"
#include "constants.h"
#include "ops/turboquant/params.h"

using namespace metal;

[[kernel]] void turboquant_write(
    const device float* key [[buffer(TQW_BUF_KEY)]],
    const device float* key_norm [[buffer(TQW_BUF_KEY_NORM)]],
    const device float* value [[buffer(TQW_BUF_VALUE)]],
    device uchar* key_cache [[buffer(TQW_BUF_KEY_CACHE)]],
    device uchar* value_cache [[buffer(TQW_BUF_VALUE_CACHE)]],
    const device long* slot_mapping [[buffer(TQW_BUF_SLOT_MAPPING)]],
    const device float* centroids [[buffer(TQW_BUF_CENTROIDS)]],
    constant TurboQuantWriteParams& p [[buffer(TQW_BUF_PARAMS)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint num_threads [[threads_per_threadgroup]]) {
  const int row = int(tg * num_threads + tid);
  if (row >= p.num_rows) {
    return;
  }
  const int token = row / p.num_kv_heads;
  const int h = row - token * p.num_kv_heads;
  const long slot = slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) {
    return;
  }
  const long block = slot / p.block_size;
  const long offset = slot % p.block_size;
  const int D = p.head_dim;
  const device float* k = key + long(row) * D;
  const device float* v = value + long(row) * D;
  device uchar* kd =
      key_cache + block * p.kc_stride_block + offset * p.kc_stride_slot + h * p.kc_stride_head;
  device uchar* vd =
      value_cache + block * p.vc_stride_block + offset * p.vc_stride_slot + h * p.vc_stride_head;

  uint idx[8];
  if (p.key_bits == 8) {
    for (int d = 0; d < D; ++d) {
      kd[d] = uchar(vm_fp8_from_float(k[d], VM_TQ_FP8_KEY_FORMAT));
    }
  } else {
    for (int g = 0; g < D / 8; ++g) {
      for (int i = 0; i < 8; ++i) {
        idx[i] = vm_tq_key_index(k[g * 8 + i], centroids, p.key_bits);
      }
      for (int b = 0; b < p.key_bits; ++b) {
        kd[g * p.key_bits + b] = uchar(vm_tq_group_byte(idx, b, p.key_bits));
      }
    }
    const int n = vm_tq_packed_bytes(D, p.key_bits);
    const float norm = key_norm[row];
    kd[n] = uchar(vm_tq_f16_byte(norm, 0));
    kd[n + 1] = uchar(vm_tq_f16_byte(norm, 1));
  }

  float vmin = v[0];
  float vmax = v[0];
  for (int d = 1; d < D; ++d) {
    vmin = metal::min(vmin, v[d]);
    vmax = metal::max(vmax, v[d]);
  }
  const float scale = vm_tq_value_scale(vmin, vmax, p.value_bits);
  for (int g = 0; g < D / 8; ++g) {
    for (int i = 0; i < 8; ++i) {
      idx[i] = vm_tq_value_index(v[g * 8 + i], vmin, scale, p.value_bits);
    }
    for (int b = 0; b < p.value_bits; ++b) {
      vd[g * p.value_bits + b] = uchar(vm_tq_group_byte(idx, b, p.value_bits));
    }
  }
  const int n = vm_tq_packed_bytes(D, p.value_bits);
  vd[n] = uchar(vm_tq_f16_byte(scale, 0));
  vd[n + 1] = uchar(vm_tq_f16_byte(scale, 1));
  vd[n + 2] = uchar(vm_tq_f16_byte(vmin, 0));
  vd[n + 3] = uchar(vm_tq_f16_byte(vmin, 1));
}
