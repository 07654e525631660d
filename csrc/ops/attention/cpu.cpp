// The CPU paged-attention driver (see cpu.h): work partitioning, split-KV, thread pool.
//
// The inner loops live in cpu_kernel.cpp (one build per instruction-set level).

#include "ops/attention/cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/convert.h"
#include "common/thread_pool.h"
#include "ops/attention/cpu_isa.h"
#include "ops/attention/cpu_kernel.h"

namespace vllm_metal::cpu {

namespace {

// Batches of few query tokens per sequence (decode) take all KV heads of a sequence in one item, so
// each key's K/V rows are read as one contiguous run; up to this many query rows per item.
constexpr int64_t kAllHeadsRows = 128;
// Longer query runs (prefill) are cut into items of one KV head and this many query rows, so each
// staged key tile serves many queries.
constexpr int64_t kRowsPerItem = 64;
// A split of a long key range is not made shorter than this.
constexpr int64_t kMinKeysPerSplit = 256;

struct ScratchArena {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buffer;
  size_t capacity = 0;  // in floats

  // Carves the per-thread buffers, each 64-byte aligned.
  Scratch get(int64_t rows, int64_t heads, int64_t tokens, int64_t D) {
    const int64_t TK = kKeyTile;
    auto round = [](int64_t n) { return (n + 15) / 16 * 16; };
    const int64_t sizes[] = {rows * D, rows * D, rows, rows, rows * TK, heads * D, tokens, tokens};
    int64_t total = 0;
    for (int64_t n : sizes) total += round(n);
    if (static_cast<size_t>(total) > capacity) {
      buffer.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
      if (!buffer) throw std::bad_alloc();
      capacity = total;
    }
    float* f = buffer.get();
    constexpr int kParts = sizeof(sizes) / sizeof(sizes[0]);
    float* parts[kParts];
    for (int i = 0; i < kParts; ++i) {
      parts[i] = f;
      f += round(sizes[i]);
    }
    Scratch sc;
    sc.q = parts[0];
    sc.o = parts[1];
    sc.m = parts[2];
    sc.l = parts[3];
    sc.p = parts[4];
    sc.zero = parts[5];
    std::fill(sc.zero, sc.zero + heads * D, 0.0f);
    sc.token_lo = reinterpret_cast<int32_t*>(parts[6]);
    sc.token_hi = reinterpret_cast<int32_t*>(parts[7]);
    return sc;
  }
};

struct SplitGroup {
  WorkItem item;    // the unsplit item (for the rows it covers)
  int64_t first_split;   // index of its first split in `splits`
  int64_t num_splits;
};

template <typename T, typename Store>
void merge_rows(const AttentionArgs& a, const WorkItem& it, const float* const* po,
                const float* const* pml, int64_t n, Store store) {
  const int64_t D = a.head_dim;
  const int64_t G = a.num_q_heads / a.num_kv_heads;
  std::vector<float> weight(n), acc(D);
  const int64_t nh = it.kv_end - it.kv_begin;
  T* out = static_cast<T*>(a.out);
  for (int64_t i = 0; i < it.q_end - it.q_begin; ++i) {
    for (int64_t x = 0; x < nh * G; ++x) {
      const int64_t r = i * nh * G + x;
      const int64_t h = it.kv_begin * G + x;
      float m = -INFINITY;
      for (int64_t p = 0; p < n; ++p) m = std::max(m, pml[p][2 * r]);
      if (a.sinks != nullptr) m = std::max(m, a.sinks[h]);
      float l = 0.0f;
      for (int64_t p = 0; p < n; ++p) {
        weight[p] = pml[p][2 * r] == -INFINITY ? 0.0f : std::exp(pml[p][2 * r] - m);
        l += weight[p] * pml[p][2 * r + 1];
      }
      if (a.sinks != nullptr) l += std::exp(a.sinks[h] - m);
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = 0; p < n; ++p) {
        const float* o = po[p] + r * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += weight[p] * o[d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      T* dst = out + ((it.q_begin + i) * a.num_q_heads + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = store(acc[d] * inv);
    }
  }
}

// Combines the (max, sum, unnormalised output) states of the splits of one item, adds the sinks and
// writes the normalised rows.
void merge_splits(const AttentionArgs& a, const WorkItem& it, const float* const* po,
                  const float* const* pml, int64_t n) {
  switch (a.dtype) {
    case ElemType::f32:
      return merge_rows<float>(a, it, po, pml, n, [](float v) { return v; });
    case ElemType::f16:
      return merge_rows<uint16_t>(a, it, po, pml, n, float_to_half);
    case ElemType::bf16:
      return merge_rows<uint16_t>(a, it, po, pml, n, float_to_bf16);
  }
}

void run(const AttentionArgs& a, RunItemFn kernel) {
  static std::mutex run_mutex;  // guards the scratch arenas
  static std::vector<ScratchArena> arenas;
  std::lock_guard<std::mutex> lock(run_mutex);

  auto& pool = ThreadPool::instance();
  const int nthreads = pool.num_threads();
  const int64_t T = a.num_tokens, S = a.num_seqs, Hkv = a.num_kv_heads, D = a.head_dim;
  const int64_t G = a.num_q_heads / Hkv;
  const int64_t kv_addressable = a.max_blocks * a.block_size;
  const int64_t W = a.sliding_window;
  const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / G);

  std::vector<WorkItem> items;
  items.reserve(static_cast<size_t>(S * Hkv));
  std::vector<uint8_t> covered(static_cast<size_t>(T), 0);
  auto add_items = [&](int64_t s, int64_t c0, int64_t i0, int64_t i1, int64_t pos0, int64_t kv_cap,
                       int64_t h0, int64_t h1) {
    const int64_t p_first = pos0 + i0;
    const int64_t p_last = pos0 + i1 - 1;
    int64_t k_begin = W > 0 ? std::max<int64_t>(0, p_first - W + 1) : 0;
    int64_t k_end = std::min(p_last + 1, kv_cap);
    k_begin = std::min(k_begin, kv_cap);
    k_end = std::max(k_end, k_begin);
    items.push_back(WorkItem{static_cast<int32_t>(s), static_cast<int32_t>(h0),
                                  static_cast<int32_t>(h1), static_cast<int32_t>(c0 + i0),
                                  static_cast<int32_t>(c0 + i1), static_cast<int32_t>(p_first),
                                  static_cast<int32_t>(k_begin), static_cast<int32_t>(k_end), -1});
  };
  for (int64_t s = 0; s < S; ++s) {
    const int64_t c0 = std::clamp<int64_t>(a.cu_seqlens_q[s], 0, T);
    const int64_t c1 = std::clamp<int64_t>(a.cu_seqlens_q[s + 1], c0, T);
    if (c1 == c0) continue;
    const int64_t q_len = c1 - c0;
    const int64_t ctx = a.seq_lens[s];
    const int64_t kv_cap = std::clamp<int64_t>(ctx, 0, kv_addressable);
    const int64_t pos0 = ctx - q_len;
    std::fill(covered.begin() + c0, covered.begin() + c1, 1);
    if (q_len * a.num_q_heads <= kAllHeadsRows) {
      add_items(s, c0, 0, q_len, pos0, kv_cap, 0, Hkv);
      continue;
    }
    for (int64_t i0 = 0; i0 < q_len; i0 += tokens_per_item) {
      const int64_t i1 = std::min(i0 + tokens_per_item, q_len);
      for (int64_t hk = 0; hk < Hkv; ++hk) add_items(s, c0, i0, i1, pos0, kv_cap, hk, hk + 1);
    }
  }

  // Tokens outside every sequence (batch padding) get zeros rather than stale memory.
  const size_t row_bytes = static_cast<size_t>(a.num_q_heads * D) *
                           (a.dtype == ElemType::f32 ? 4 : 2);
  for (int64_t t = 0; t < T; ++t) {
    if (!covered[t]) std::memset(static_cast<char*>(a.out) + t * row_bytes, 0, row_bytes);
  }

  // Few items (small batches) leave threads idle: split their KV heads and/or key ranges; key
  // splits write partial softmax states that are merged afterwards.
  std::vector<WorkItem> work;
  std::vector<SplitGroup> groups;
  std::vector<int64_t> split_offset;  // float offset of each split's partial output
  int64_t partial_floats = 0;
  const int64_t target = 2 * static_cast<int64_t>(nthreads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  if (nthreads > 1 && num_items > 0 && num_items < target) {
    const int64_t want = (target + num_items - 1) / num_items;
    for (const auto& it : items) {
      const int64_t span = it.k_end - it.k_begin;
      const int64_t nh = it.kv_end - it.kv_begin;
      const int64_t key_splits = std::clamp<int64_t>(span / kMinKeysPerSplit, 1, want);
      const int64_t head_splits = std::min(nh, (want + key_splits - 1) / key_splits);
      for (int64_t hs = 0; hs < head_splits; ++hs) {
        WorkItem part = it;
        part.kv_begin = static_cast<int32_t>(it.kv_begin + nh * hs / head_splits);
        part.kv_end = static_cast<int32_t>(it.kv_begin + nh * (hs + 1) / head_splits);
        if (key_splits < 2) {
          work.push_back(part);
          continue;
        }
        const int64_t rows = static_cast<int64_t>(part.q_end - part.q_begin) *
                             (part.kv_end - part.kv_begin) * G;
        groups.push_back(SplitGroup{part, static_cast<int64_t>(split_offset.size()), key_splits});
        for (int64_t p = 0; p < key_splits; ++p) {
          WorkItem sp = part;
          sp.k_begin = static_cast<int32_t>(it.k_begin + span * p / key_splits);
          sp.k_end = static_cast<int32_t>(it.k_begin + span * (p + 1) / key_splits);
          sp.partial = static_cast<int32_t>(split_offset.size());
          split_offset.push_back(partial_floats);
          partial_floats += rows * (D + 2);
          work.push_back(sp);
        }
      }
    }
  } else {
    work = std::move(items);
  }
  // Longest first, so the dynamic schedule ends evenly.
  auto cost = [](const WorkItem& x) {
    return static_cast<int64_t>(x.k_end - x.k_begin + 1) * (x.q_end - x.q_begin) *
           (x.kv_end - x.kv_begin);
  };
  std::stable_sort(work.begin(), work.end(), [&](const WorkItem& x, const WorkItem& y) {
    return cost(x) > cost(y);
  });

  int64_t max_rows = 1, max_heads = 1, max_tokens = 1;
  for (const auto& it : work) {
    const int64_t nq = it.q_end - it.q_begin, nh = it.kv_end - it.kv_begin;
    max_rows = std::max(max_rows, nq * nh * G);
    max_heads = std::max(max_heads, nh);
    max_tokens = std::max(max_tokens, nq);
  }
  if (arenas.size() < static_cast<size_t>(nthreads)) arenas.resize(nthreads);
  std::vector<Scratch> scratch(nthreads);
  for (int t = 0; t < nthreads; ++t) {
    scratch[t] = arenas[t].get(max_rows, max_heads, max_tokens, D);
  }
  std::unique_ptr<float[]> partials(partial_floats > 0 ? new float[partial_floats] : nullptr);

  pool.parallel_for(static_cast<int64_t>(work.size()), [&](int64_t i, int tid) {
    const auto& it = work[i];
    float* po = nullptr;
    float* pml = nullptr;
    if (it.partial >= 0) {
      const int64_t rows =
          static_cast<int64_t>(it.q_end - it.q_begin) * (it.kv_end - it.kv_begin) * G;
      po = partials.get() + split_offset[it.partial];
      pml = po + rows * D;
    }
    kernel(a, it, scratch[tid], po, pml);
  }, nthreads);

  for (const auto& g : groups) {
    std::vector<const float*> po(g.num_splits), pml(g.num_splits);
    const int64_t rows =
        static_cast<int64_t>(g.item.q_end - g.item.q_begin) * (g.item.kv_end - g.item.kv_begin) * G;
    for (int64_t p = 0; p < g.num_splits; ++p) {
      po[p] = partials.get() + split_offset[g.first_split + p];
      pml[p] = po[p] + rows * D;
    }
    merge_splits(a, g.item, po.data(), pml.data(), g.num_splits);
  }
}

}  // namespace

AttentionArgs attention_args(const Strided& query, const Strided& key_cache,
                             const Strided& value_cache, const Strided& block_tables,
                             const int32_t* seq_lens, const int32_t* cu_seqlens_q,
                             const float* sinks, void* out, ElemType dtype, float scale,
                             int32_t sliding_window, float softcap) {
  return {
      .query = query.data,
      .key_cache = key_cache.data,
      .value_cache = value_cache.data,
      .block_tables = static_cast<const int32_t*>(block_tables.data),
      .seq_lens = seq_lens,
      .cu_seqlens_q = cu_seqlens_q,
      .sinks = sinks,
      .out = out,
      .dtype = dtype,
      .num_tokens = query.shape[0],
      .num_seqs = block_tables.shape[0],
      .num_q_heads = query.shape[1],
      .num_kv_heads = key_cache.shape[2],
      .head_dim = query.shape[2],
      .num_blocks = key_cache.shape[0],
      .block_size = key_cache.shape[1],
      .max_blocks = block_tables.shape[1],
      .q_stride_t = query.strides[0],
      .q_stride_h = query.strides[1],
      .q_stride_d = query.strides[2],
      .kc_stride_b = key_cache.strides[0],
      .kc_stride_o = key_cache.strides[1],
      .vc_stride_b = value_cache.strides[0],
      .vc_stride_o = value_cache.strides[1],
      .scale = scale,
      .sliding_window = sliding_window,
      .softcap = softcap,
      .kv_row = key_cache.shape[3],
  };
}

void paged_attention(const AttentionArgs& args, int isa) {
  if (args.num_tokens == 0) return;
  run(args, kernel_for(isa));
}

}  // namespace vllm_metal::cpu
