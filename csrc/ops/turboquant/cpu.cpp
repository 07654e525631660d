// The CPU drivers of the TurboQuant KV ops (see cpu.h). Every byte is stored and read through
// common/turboquant.h, the statement the Metal kernels include too.

#include "ops/turboquant/cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8.h"
#include "common/thread_pool.h"
#include "common/turboquant.h"

namespace vllm_metal::cpu {

namespace {

// Below this many rows a write runs on the calling thread alone.
constexpr int64_t kParallelRows = 256;
// Keys scored at once before their values are summed.
constexpr int64_t kKeyTile = 32;
// A split of a long key range is not made shorter than this.
constexpr int64_t kMinKeysPerSplit = 256;

void write_key(const float* k, float norm, const float* centroids, int bits, int64_t D,
               uint8_t* dst) {
  if (bits == 8) {
    for (int64_t d = 0; d < D; ++d) {
      dst[d] = static_cast<uint8_t>(vm_fp8_from_float(k[d], VM_TQ_FP8_KEY_FORMAT));
    }
    return;
  }
  vm_u32 idx[8];
  for (int64_t g = 0; g < D / 8; ++g) {
    for (int i = 0; i < 8; ++i) idx[i] = vm_tq_key_index(k[g * 8 + i], centroids, bits);
    for (int b = 0; b < bits; ++b) dst[g * bits + b] = vm_tq_group_byte(idx, b, bits);
  }
  const int64_t n = vm_tq_packed_bytes(static_cast<int>(D), bits);
  dst[n] = static_cast<uint8_t>(vm_tq_f16_byte(norm, 0));
  dst[n + 1] = static_cast<uint8_t>(vm_tq_f16_byte(norm, 1));
}

void write_value(const float* v, int bits, int64_t D, uint8_t* dst) {
  float vmin = v[0], vmax = v[0];
  for (int64_t d = 1; d < D; ++d) {
    vmin = std::min(vmin, v[d]);
    vmax = std::max(vmax, v[d]);
  }
  const float scale = vm_tq_value_scale(vmin, vmax, bits);
  vm_u32 idx[8];
  for (int64_t g = 0; g < D / 8; ++g) {
    for (int i = 0; i < 8; ++i) idx[i] = vm_tq_value_index(v[g * 8 + i], vmin, scale, bits);
    for (int b = 0; b < bits; ++b) dst[g * bits + b] = vm_tq_group_byte(idx, b, bits);
  }
  const int64_t n = vm_tq_packed_bytes(static_cast<int>(D), bits);
  dst[n] = static_cast<uint8_t>(vm_tq_f16_byte(scale, 0));
  dst[n + 1] = static_cast<uint8_t>(vm_tq_f16_byte(scale, 1));
  dst[n + 2] = static_cast<uint8_t>(vm_tq_f16_byte(vmin, 0));
  dst[n + 3] = static_cast<uint8_t>(vm_tq_f16_byte(vmin, 1));
}

void write_rows(const TqWriteArgs& w, int64_t t0, int64_t t1) {
  const int64_t H = w.num_heads, D = w.head_dim;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t slot = w.slots[t];
    if (slot < 0 || slot >= w.num_slots) continue;
    const int64_t block = slot / w.block_size, offset = slot % w.block_size;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = (t * H + h) * D;
      uint8_t* kd = w.key_cache.data + block * w.key_cache.stride_block +
                    offset * w.key_cache.stride_slot + h * w.key_cache.stride_head;
      uint8_t* vd = w.value_cache.data + block * w.value_cache.stride_block +
                    offset * w.value_cache.stride_slot + h * w.value_cache.stride_head;
      const float norm = w.format.key_bits == 8 ? 0.0f : w.key_norm[t * H + h];
      write_key(w.key + row, norm, w.centroids, w.format.key_bits, D, kd);
      write_value(w.value + row, w.format.value_bits, D, vd);
    }
  }
}

// One unit of attention work: query row `token` of sequence `seq`, the query heads of KV head
// `kvh`, keys [k_begin, k_end); its (max, sum, unnormalised output) per head go to `state`.
struct Item {
  int64_t token, seq, kvh, k_begin, k_end;
  float* state;  // [G, D + 2]: output, then max and sum
};

// A pool row's bytes for key position `pos` of a sequence's block table, or nullptr (unmapped).
const uint8_t* row_of(const TqPool& pool, const int32_t* table, int64_t pos, int64_t kvh,
                      const TqAttentionArgs& a) {
  const int64_t block = table[pos / a.block_size];
  if (block < 0 || block >= a.num_blocks) return nullptr;
  return pool.data + block * pool.stride_block + (pos % a.block_size) * pool.stride_slot +
         kvh * pool.stride_head;
}

// sum(x[d] * y[d]) over d < n (a multiple of 8) in eight running sums, so the loop vectorises.
inline float dot8(const float* x, const float* y, int64_t n) {
  float part[8] = {};
  for (int64_t d = 0; d < n; d += 8) {
    for (int u = 0; u < 8; ++u) part[u] += x[d + u] * y[d + u];
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The value of every fp8 key byte (common/fp8.h), built once.
struct Fp8Keys {
  float v[256];
  Fp8Keys() {
    for (int c = 0; c < 256; ++c) v[c] = vm_fp8_to_float(static_cast<vm_u32>(c), VM_TQ_FP8_KEY_FORMAT);
  }
};
const Fp8Keys kFp8Keys;

// One item with the key and value bits known at compile time (the unpacking folds to shifts).
template <int KB, int VB>
void attend(const TqAttentionArgs& a, const Item& it, std::vector<float>& k,
            std::vector<float>& s) {
  const int64_t D = a.head_dim, G = a.num_q_heads / a.num_kv_heads;
  const int di = static_cast<int>(D);
  const int32_t* table = a.block_tables + it.seq * a.max_blocks;
  const float* q = a.query + (it.token * a.num_q_heads + it.kvh * G) * D;
  float* st = it.state;
  for (int64_t g = 0; g < G; ++g) {
    std::fill(st + g * (D + 2), st + g * (D + 2) + D, 0.0f);
    st[g * (D + 2) + D] = -INFINITY;
    st[g * (D + 2) + D + 1] = 0.0f;
  }
  for (int64_t j0 = it.k_begin; j0 < it.k_end; j0 += kKeyTile) {
    const int64_t n = std::min(kKeyTile, it.k_end - j0);
    // Scores of the tile's keys for every head: s[g * kKeyTile + j].
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* row = row_of(a.key_cache, table, j0 + j, it.kvh, a);
      float factor = 0.0f;
      if (row != nullptr && KB == 8) {
        for (int64_t d = 0; d < D; ++d) k[d] = kFp8Keys.v[row[d]];
        factor = 1.0f;
      } else if (row != nullptr) {
        for (int d = 0; d < di; ++d) k[d] = a.centroids[vm_tq_index(row, d, KB)];
        const float csq = dot8(k.data(), k.data(), D);
        const int nb = vm_tq_packed_bytes(di, KB);
        factor = vm_tq_f16(row[nb], row[nb + 1]);
        if (a.format.norm_correction) factor /= std::sqrt(csq + VM_TQ_CENTROID_EPS);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float dot = dot8(q + g * D, k.data(), D);
        float x = row != nullptr ? dot * factor * a.scale : 0.0f;
        if (a.softcap > 0.0f) x = a.softcap * std::tanh(x / a.softcap);
        s[g * kKeyTile + j] = x;
      }
    }
    // Fold the tile into each head's running max and sum; s becomes the probabilities.
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.data() + g * kKeyTile;
      float* o = st + g * (D + 2);
      float m = o[D];
      for (int64_t j = 0; j < n; ++j) m = std::max(m, sg[j]);
      const float alpha = std::exp(o[D] - m);
      float l = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - m);
        l += sg[j];
      }
      o[D] = m;
      o[D + 1] = o[D + 1] * alpha + l;
      for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
    }
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* row = row_of(a.value_cache, table, j0 + j, it.kvh, a);
      if (row == nullptr) continue;
      const float scale = vm_tq_row_scale(row, di, VB), vmin = vm_tq_row_min(row, di, VB);
      for (int d = 0; d < di; ++d) k[d] = vm_tq_dequant(vm_tq_index(row, d, VB), scale, vmin);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g * kKeyTile + j];
        float* o = st + g * (D + 2);
        for (int64_t d = 0; d < D; ++d) o[d] += p * k[d];
      }
    }
  }
}

using AttendFn = void (*)(const TqAttentionArgs&, const Item&, std::vector<float>&,
                          std::vector<float>&);

AttendFn attend_for(const TqFormat& f) {
  const int vb = f.value_bits;
  switch (f.key_bits) {
    case 8:
      return vb == 3 ? attend<8, 3> : attend<8, 4>;
    case 4:
      return vb == 3 ? attend<4, 3> : attend<4, 4>;
    default:
      return vb == 3 ? attend<3, 3> : attend<3, 4>;
  }
}

}  // namespace

void turboquant_write(const TqWriteArgs& w) {
  auto& pool = ThreadPool::instance();
  if (w.num_tokens * w.num_heads < kParallelRows || pool.num_threads() == 1) {
    return write_rows(w, 0, w.num_tokens);
  }
  const int64_t chunks = std::min<int64_t>(w.num_tokens, 4 * pool.num_threads());
  pool.parallel_for(chunks, [&](int64_t i, int) {
    write_rows(w, w.num_tokens * i / chunks, w.num_tokens * (i + 1) / chunks);
  }, pool.num_threads());
}

void turboquant_attention(const TqAttentionArgs& a) {
  const int64_t T = a.num_tokens, D = a.head_dim, Hkv = a.num_kv_heads;
  const int64_t G = a.num_q_heads / Hkv, W = a.sliding_window;
  std::fill(a.out, a.out + T * a.num_q_heads * D, 0.0f);  // rows of no sequence stay zero
  struct Row {
    int64_t token, seq, k_begin, k_end;
  };
  std::vector<Row> rows;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t c0 = std::clamp<int64_t>(a.cu_seqlens_q[s], 0, T);
    const int64_t c1 = std::clamp<int64_t>(a.cu_seqlens_q[s + 1], c0, T);
    const int64_t ctx = a.seq_lens[s];
    const int64_t cap = std::clamp<int64_t>(ctx, 0, a.max_blocks * a.block_size);
    for (int64_t t = c0; t < c1; ++t) {
      const int64_t pos = ctx - (c1 - c0) + (t - c0);
      const int64_t hi = std::clamp<int64_t>(pos + 1, 0, cap);
      const int64_t lo = std::min(W > 0 ? std::max<int64_t>(0, pos - W + 1) : 0, hi);
      rows.push_back({t, s, lo, hi});
    }
  }
  // Split each row's keys so that the pool has about two items per thread.
  auto& pool = ThreadPool::instance();
  const int64_t units = static_cast<int64_t>(rows.size()) * Hkv;
  if (units == 0) return;
  const int64_t want = std::max<int64_t>(1, (2 * pool.num_threads() + units - 1) / units);
  std::vector<int64_t> splits(rows.size()), first(rows.size() + 1, 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    splits[r] = std::clamp<int64_t>((rows[r].k_end - rows[r].k_begin) / kMinKeysPerSplit, 1, want);
    first[r + 1] = first[r] + splits[r];
  }
  const int64_t per_state = G * (D + 2);
  std::vector<float> states(static_cast<size_t>(first.back() * Hkv * per_state));
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(first.back() * Hkv));
  for (size_t r = 0; r < rows.size(); ++r) {
    const Row& row = rows[r];
    const int64_t span = row.k_end - row.k_begin;
    for (int64_t p = 0; p < splits[r]; ++p) {
      for (int64_t h = 0; h < Hkv; ++h) {
        float* st = states.data() + ((first[r] + p) * Hkv + h) * per_state;
        items.push_back({row.token, row.seq, h, row.k_begin + span * p / splits[r],
                         row.k_begin + span * (p + 1) / splits[r], st});
      }
    }
  }
  const int nthreads = pool.num_threads();
  std::vector<std::vector<float>> k(nthreads, std::vector<float>(D)),
      s(nthreads, std::vector<float>(G * kKeyTile));
  const AttendFn attend_item = attend_for(a.format);
  pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t i, int tid) {
    attend_item(a, items[i], k[tid], s[tid]);
  }, nthreads);
  // Merge each row's splits per head, with the sink as one more key of value zero.
  for (size_t r = 0; r < rows.size(); ++r) {
    for (int64_t h = 0; h < a.num_q_heads; ++h) {
      const int64_t kvh = h / G, g = h % G;
      auto state = [&](int64_t p) {
        return states.data() + ((first[r] + p) * Hkv + kvh) * per_state + g * (D + 2);
      };
      float m = a.sinks != nullptr ? a.sinks[h] : -INFINITY;
      for (int64_t p = 0; p < splits[r]; ++p) m = std::max(m, state(p)[D]);
      float* out = a.out + (rows[r].token * a.num_q_heads + h) * D;
      if (m == -INFINITY) continue;  // no key and no sink: zeros
      float l = a.sinks != nullptr ? std::exp(a.sinks[h] - m) : 0.0f;
      for (int64_t p = 0; p < splits[r]; ++p) {
        const float* st = state(p);
        if (st[D] == -INFINITY) continue;
        const float w = std::exp(st[D] - m);
        l += w * st[D + 1];
        for (int64_t d = 0; d < D; ++d) out[d] += w * st[d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv;
    }
  }
}

}  // namespace vllm_metal::cpu
