// Kernel choice rules for the Metal ops (see kernel_select.h and metal_kernels/README.md).
#include "kernel_select.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

namespace vllm_metal {

namespace {

const char* const kDtypes[] = {"f32", "f16", "bf16"};
const int kHeadDims[] = {64, 80, 96, 128, 256, 512};
constexpr int kMaxDecodeHeadDim = 256;

int dtype_size(const std::string& dtype) {
  if (dtype == "f32") return 4;
  if (dtype == "f16" || dtype == "bf16") return 2;
  throw std::invalid_argument("paged attention: unsupported dtype '" + dtype +
                              "' (float32, float16 or bfloat16)");
}

bool supported_head_dim(int d) {
  return std::find(std::begin(kHeadDims), std::end(kHeadDims), d) != std::end(kHeadDims);
}

// Largest kernel block (8, 16, 32) dividing the vLLM block size: a KV tile never spans two blocks.
int kernel_block_cap(int block_size) {
  if (block_size % 32 == 0) return 32;
  if (block_size % 16 == 0) return 16;
  return 8;
}

// Threadgroup bytes of paged_attention_gqa<T, D, KB> (mirrors the static_assert there).
int gqa_memory(int size, int d, int kb) {
  const int pad = 16 / size, qp = d + pad, pp = kb + pad, sp = kb + 4;
  return (8 * qp + kb * qp + 8 * pp) * size + (8 * sp + 64) * 4;
}

// Threadgroup bytes of paged_attention_prefill<T, D, BQ, KB>.
int prefill_memory(int size, int d, int bq, int kb) {
  const int pad = 16 / size, dv = std::min(d, 256);
  const int qp = d + pad, vp = dv + pad, sp = kb + 4, pp = kb + pad;
  return (bq * qp + kb * qp + kb * vp + bq * pp) * size + (bq * sp + (bq / 8) * 64) * 4;
}

int gqa_kernel_block(int size, int d, int cap) {
  for (int kb : {32, 16, 8}) {
    if (kb <= cap && gqa_memory(size, d, kb) <= kThreadgroupMemoryBytes) return kb;
  }
  return 0;
}

// (rows per tile, kernel block) of the tiled prefill kernel: the largest tile that fits.
bool prefill_tile(int size, int d, int cap, int& bq, int& kb) {
  static const int kCandidates[][2] = {{32, 32}, {32, 16}, {16, 32}, {16, 16},
                                       {32, 8},  {16, 8},  {8, 8}};
  for (const auto& c : kCandidates) {
    if (c[1] <= cap && prefill_memory(size, d, c[0], c[1]) <= kThreadgroupMemoryBytes) {
      bq = c[0];
      kb = c[1];
      return true;
    }
  }
  return false;
}

std::string dim_name(const std::string& dtype, int d) {
  return dtype + "_d" + std::to_string(d);
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Keys attended by the last query token of a sequence of seq_len tokens.
int attended_keys(int seq_len, int window) {
  return window > 0 ? std::min(seq_len, window) : seq_len;
}

}  // namespace

bool env_flag(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return false;
  std::string v(raw);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

AttentionPlan select_paged_attention_kernel(
    const AttentionShape& shape, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
    int num_seqs, const DeviceCaps& caps) {
  const int size = dtype_size(shape.dtype);
  const int d = shape.head_dim;
  if (!supported_head_dim(d)) {
    throw std::invalid_argument("paged attention: head_dim " + std::to_string(d) +
                                " is not one of 64, 80, 96, 128, 256, 512");
  }
  if (shape.block_size <= 0 || shape.block_size % 8 != 0) {
    throw std::invalid_argument("paged attention: block_size " + std::to_string(shape.block_size) +
                                " must be a positive multiple of 8");
  }
  if (shape.num_kv_heads <= 0 || shape.num_q_heads % shape.num_kv_heads != 0) {
    throw std::invalid_argument("paged attention: num_q_heads must be a multiple of num_kv_heads");
  }
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int cap = kernel_block_cap(shape.block_size);
  const bool disable_gqa = env_flag("VLLM_METAL_DISABLE_GQA_DECODE");
  const bool disable_nax = env_flag("VLLM_METAL_DISABLE_NAX");

  std::vector<int> prefill_seqs, decode_seqs;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
    if (q_len <= 0) continue;
    if (q_len == 1 && d <= kMaxDecodeHeadDim) {
      decode_seqs.push_back(s);
    } else {
      prefill_seqs.push_back(s);
    }
  }
  // In a mixed batch only long decode rows get their own (split-KV capable) dispatch.
  if (!prefill_seqs.empty()) {
    std::vector<int> long_rows;
    for (int s : decode_seqs) {
      if (attended_keys(seq_lens[s], shape.sliding_window) >= kDecodeSplitOutContext) {
        long_rows.push_back(s);
      } else {
        prefill_seqs.push_back(s);
      }
    }
    decode_seqs.swap(long_rows);
    std::sort(prefill_seqs.begin(), prefill_seqs.end());
  }

  AttentionPlan plan;
  if (!prefill_seqs.empty()) {
    AttentionLaunch l;
    const bool nax = caps.supports_nax && !disable_nax && shape.dtype != "f32" &&
                     shape.block_size % 16 == 0;
    if (nax) {
      l.family = "nax";
      l.kernel = "paged_attention_nax_" + dim_name(shape.dtype, d);
      l.rows_per_tile = 16;
      l.kernel_block = 16;
      l.threads = 128;
    } else {
      int bq = 0, kb = 0;
      if (!prefill_tile(size, d, cap, bq, kb)) {
        throw std::invalid_argument("paged attention: head_dim " + std::to_string(d) +
                                    " is not supported for " + shape.dtype +
                                    " (threadgroup memory); use float16 or bfloat16");
      }
      l.family = "prefill";
      l.kernel = "paged_attention_prefill_" + dim_name(shape.dtype, d) + "_q" +
                 std::to_string(bq) + "_k" + std::to_string(kb);
      l.rows_per_tile = bq;
      l.kernel_block = kb;
      l.threads = bq * 4;
    }
    for (int s : prefill_seqs) {
      const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
      const int tiles = ceil_div(q_len * group, l.rows_per_tile);
      for (int t = 0; t < tiles; ++t) {
        l.work.push_back(s);
        l.work.push_back(t);
      }
    }
    l.grid[0] = static_cast<int>(l.work.size() / 2);
    l.grid[1] = shape.num_kv_heads * (d > 256 ? d / 256 : 1);
    plan.launches.push_back(std::move(l));
  }

  if (!decode_seqs.empty()) {
    AttentionLaunch l;
    const int rows = static_cast<int>(decode_seqs.size());
    const bool gqa = group > 1 && !disable_gqa;
    int base_groups = 0;
    if (gqa) {
      const int row_tiles = ceil_div(group, 8);
      l.family = "gqa";
      l.kernel_block = gqa_kernel_block(size, d, cap);
      l.kernel = "paged_attention_gqa_" + dim_name(shape.dtype, d) + "_k" +
                 std::to_string(l.kernel_block);
      l.grid[0] = shape.num_kv_heads * row_tiles;
      l.scratch_heads = shape.num_kv_heads * row_tiles * 8;
    } else {
      l.family = "decode";
      l.kernel_block = cap;
      l.kernel = "paged_attention_decode_" + dim_name(shape.dtype, d) + "_k" +
                 std::to_string(cap);
      l.grid[0] = shape.num_q_heads;
      l.scratch_heads = shape.num_q_heads;
    }
    l.threads = 128;
    l.grid[1] = rows;
    base_groups = l.grid[0] * rows;
    l.work.assign(decode_seqs.begin(), decode_seqs.end());

    int max_keys = 0;
    for (int s : decode_seqs) {
      max_keys = std::max(max_keys, attended_keys(seq_lens[s], shape.sliding_window));
    }
    const bool split = max_keys > kPartitionSize && base_groups < 8 * caps.gpu_cores;
    if (split) {
      l.partition_size = kPartitionSize;
      l.part_offsets.push_back(0);
      int max_parts = 1;
      for (int s : decode_seqs) {
        const int seq_len = seq_lens[s];
        const int lo = shape.sliding_window > 0 ? std::max(0, seq_len - shape.sliding_window) : 0;
        const int base = lo - lo % 32;
        const int parts = std::max(1, ceil_div(seq_len - base, kPartitionSize));
        max_parts = std::max(max_parts, parts);
        l.part_offsets.push_back(l.part_offsets.back() + parts);
      }
      l.total_partitions = l.part_offsets.back();
      l.grid[2] = max_parts;
      l.reduce_kernel = "paged_attention_reduce_" + dim_name(shape.dtype, d);
      l.reduce_grid[0] = shape.num_q_heads;
      l.reduce_grid[1] = rows;
      l.reduce_threads = 128;
    } else {
      l.scratch_heads = 0;
    }
    plan.launches.push_back(std::move(l));
  }
  return plan;
}

CacheLaunch select_reshape_and_cache_kernel(
    const std::string& dtype, int num_kv_heads, int head_dim) {
  dtype_size(dtype);
  CacheLaunch c;
  c.kernel = "reshape_and_cache_" + dtype;
  const int elems = std::max(1, num_kv_heads * head_dim);
  c.threads = std::min(256, ceil_div(elems, 32) * 32);
  return c;
}

std::vector<std::string> all_kernel_names() {
  std::vector<std::string> names;
  auto add = [&](const std::string& n) {
    if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  };
  for (const char* dt_c : kDtypes) {
    const std::string dt(dt_c);
    const int size = dtype_size(dt);
    add("reshape_and_cache_" + dt);
    for (int d : kHeadDims) {
      for (int cap : {8, 16, 32}) {
        int bq = 0, kb = 0;
        if (prefill_tile(size, d, cap, bq, kb)) {
          add("paged_attention_prefill_" + dim_name(dt, d) + "_q" + std::to_string(bq) + "_k" +
              std::to_string(kb));
        }
        if (d <= kMaxDecodeHeadDim) {
          add("paged_attention_decode_" + dim_name(dt, d) + "_k" + std::to_string(cap));
          add("paged_attention_gqa_" + dim_name(dt, d) + "_k" +
              std::to_string(gqa_kernel_block(size, d, cap)));
        }
      }
      if (d <= kMaxDecodeHeadDim) add("paged_attention_reduce_" + dim_name(dt, d));
      if (dt != "f32") add("paged_attention_nax_" + dim_name(dt, d));
    }
  }
  return names;
}

namespace nb = nanobind;

namespace {

nb::dict launch_to_dict(const AttentionLaunch& l) {
  nb::dict d;
  d["family"] = l.family;
  d["kernel"] = l.kernel;
  d["grid"] = std::vector<int>(l.grid, l.grid + 3);
  d["threads"] = l.threads;
  d["rows_per_tile"] = l.rows_per_tile;
  d["kernel_block"] = l.kernel_block;
  d["work"] = l.work;
  d["partition_size"] = l.partition_size;
  d["part_offsets"] = l.part_offsets;
  d["total_partitions"] = l.total_partitions;
  d["scratch_heads"] = l.scratch_heads;
  d["reduce_kernel"] = l.reduce_kernel;
  d["reduce_grid"] = std::vector<int>(l.reduce_grid, l.reduce_grid + 3);
  d["reduce_threads"] = l.reduce_threads;
  return d;
}

}  // namespace

void bind_kernel_select(nb::module_& m) {
  m.def(
      "select_paged_attention_kernel",
      [](const std::string& dtype, int num_q_heads, int num_kv_heads, int head_dim,
         int block_size, const std::vector<int32_t>& cu_seqlens_q,
         const std::vector<int32_t>& seq_lens, int sliding_window, bool supports_nax,
         int gpu_cores) {
        if (cu_seqlens_q.size() != seq_lens.size() + 1) {
          throw std::invalid_argument("cu_seqlens_q must have len(seq_lens) + 1 entries");
        }
        AttentionShape shape{dtype, num_q_heads, num_kv_heads, head_dim, block_size,
                             sliding_window};
        DeviceCaps caps{supports_nax, gpu_cores};
        const AttentionPlan plan = select_paged_attention_kernel(
            shape, cu_seqlens_q.data(), seq_lens.data(), static_cast<int>(seq_lens.size()), caps);
        nb::list launches;
        for (const auto& l : plan.launches) launches.append(launch_to_dict(l));
        nb::dict out;
        out["launches"] = launches;
        return out;
      },
      nb::arg("dtype"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
      nb::arg("block_size"), nb::arg("cu_seqlens_q"), nb::arg("seq_lens"),
      nb::arg("sliding_window") = 0, nb::arg("supports_nax") = false,
      nb::arg("gpu_cores") = 16,
      "Kernel plan of one paged-attention call: {'launches': [dispatch dicts]}.");
  m.def(
      "select_reshape_and_cache_kernel",
      [](const std::string& dtype, int num_kv_heads, int head_dim) {
        const CacheLaunch c = select_reshape_and_cache_kernel(dtype, num_kv_heads, head_dim);
        nb::dict d;
        d["kernel"] = c.kernel;
        d["threads"] = c.threads;
        return d;
      },
      nb::arg("dtype"), nb::arg("num_kv_heads"), nb::arg("head_dim"),
      "Kernel and threadgroup size of one reshape_and_cache call.");
  m.def("all_kernel_names", &all_kernel_names,
        "Every Metal kernel name the host can request (each must be instantiated).");
}

}  // namespace vllm_metal
