// The planner of paged_attention's Metal dispatches (see plan.h and metal_kernels/README.md).
#include "ops/attention/plan.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "common/device.h"

namespace vllm_metal {

namespace {

// One [[host_name]] instance of constants.h: dtype tag, head size, block divisor, name.
struct Instance {
  const char* dtype;
  int head_dim;
  int divisor;  // 0 for the families built per head size only (reduce, nax)
  const char* name;
};

#define VM_DECODE_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_DECODE(DT, D, B)},
#define VM_GQA_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_GQA(DT, D, B)},
#define VM_PREFILL_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_PREFILL(DT, D, B)},
#define VM_REDUCE_(DT, T, BYTES, D) {#DT, D, 0, VM_KERNEL_NAME_REDUCE(DT, D)},
#define VM_NAX_(DT, T, BYTES, D) {#DT, D, 0, VM_KERNEL_NAME_NAX(DT, D)},
#define VM_DECODE_FP8_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_DECODE_FP8(DT, D, B)},
#define VM_GQA_FP8_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_GQA_FP8(DT, D, B)},
#define VM_PREFILL_FP8_(DT, T, BYTES, D, B) {#DT, D, B, VM_KERNEL_NAME_PREFILL_FP8(DT, D, B)},
#define VM_NAX_FP8_(DT, T, BYTES, D) {#DT, D, 0, VM_KERNEL_NAME_NAX_FP8(DT, D)},
const Instance kDecode[] = {VM_DECODE_INSTANCES(VM_DECODE_)};
const Instance kGqa[] = {VM_DECODE_INSTANCES(VM_GQA_)};
const Instance kReduce[] = {VM_REDUCE_INSTANCES(VM_REDUCE_)};
const Instance kPrefill[] = {VM_PREFILL_INSTANCES(VM_PREFILL_)};
const Instance kNax[] = {VM_NAX_INSTANCES(VM_NAX_)};
const Instance kDecodeFp8[] = {VM_DECODE_INSTANCES(VM_DECODE_FP8_)};
const Instance kGqaFp8[] = {VM_DECODE_INSTANCES(VM_GQA_FP8_)};
const Instance kPrefillFp8[] = {VM_PREFILL_INSTANCES(VM_PREFILL_FP8_)};
const Instance kNaxFp8[] = {VM_NAX_INSTANCES(VM_NAX_FP8_)};
#undef VM_DECODE_
#undef VM_GQA_
#undef VM_PREFILL_
#undef VM_REDUCE_
#undef VM_NAX_
#undef VM_DECODE_FP8_
#undef VM_GQA_FP8_
#undef VM_PREFILL_FP8_
#undef VM_NAX_FP8_

// The instances of each family a shape reads its pools with: the query's dtype, or fp8 bytes.
// The split-KV reduce kernel reads no pool and serves both.
struct Families {
  const Instance* decode;
  size_t n_decode;
  const Instance* gqa;
  size_t n_gqa;
  const Instance* prefill;
  size_t n_prefill;
  const Instance* nax;
  size_t n_nax;
};
template <size_t A, size_t B, size_t C, size_t D>
constexpr Families families(const Instance (&decode)[A], const Instance (&gqa)[B],
                            const Instance (&prefill)[C], const Instance (&nax)[D]) {
  return {decode, A, gqa, B, prefill, C, nax, D};
}
const Families kSame = families(kDecode, kGqa, kPrefill, kNax);
const Families kFp8 = families(kDecodeFp8, kGqaFp8, kPrefillFp8, kNaxFp8);
const Families& families_of(const AttentionShape& shape) { return shape.fp8_pools ? kFp8 : kSame; }

const Instance* find(const Instance* table, size_t n, const std::string& dtype, int d,
                     int divisor) {
  for (size_t i = 0; i < n; ++i) {
    const Instance& k = table[i];
    if (dtype == k.dtype && k.head_dim == d && k.divisor == divisor) return &k;
  }
  return nullptr;
}
template <size_t N>
const Instance* find(const Instance (&table)[N], const std::string& dtype, int d, int divisor) {
  return find(table, N, dtype, d, divisor);
}

template <size_t N>
void append_names(std::vector<std::string>& names, const Instance (&table)[N]) {
  for (const Instance& k : table) names.push_back(k.name);
}

int dtype_bytes(const std::string& dtype) {
#define VM_BYTES_(DT, T, NAME, BYTES, ...) \
  if (dtype == #DT) return BYTES;
  VM_FLOAT_DTYPES(VM_BYTES_)
#undef VM_BYTES_
  throw std::invalid_argument("paged attention: unsupported dtype '" + dtype + "'");
}

[[noreturn]] void no_kernel(const char* family, const AttentionShape& shape) {
  throw std::invalid_argument("paged attention: no Metal " + std::string(family) +
                              " kernel for dtype " + shape.dtype + ", head_dim " +
                              std::to_string(shape.head_dim) + ", block_size " +
                              std::to_string(shape.block_size) + " (instances: constants.h)");
}

// True when the environment variable is set to 1/true/yes/on (case-insensitive).
bool env_flag(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr) return false;
  std::string v(raw);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  return v == "1" || v == "true" || v == "yes" || v == "on";
}

bool listed_head_size(int d) {
#define VM_IS_(D, ...) \
  if (d == D) return true;
  VM_HEAD_SIZES(VM_IS_)
#undef VM_IS_
  return false;
}

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Keys attended by the last query token of a sequence of seq_len tokens.
int attended_keys(int seq_len, int window) {
  return window > 0 ? std::min(seq_len, window) : seq_len;
}

AttentionLaunch plan_prefill(const AttentionShape& shape, const std::vector<int>& seqs,
                             const int32_t* cu_seqlens_q, int bytes, int divisor,
                             const DeviceCaps& caps) {
  const int d = shape.head_dim;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  AttentionLaunch l;
  const Families& f = families_of(shape);
  const Instance* nax = find(f.nax, f.n_nax, shape.dtype, d, 0);
  if (nax != nullptr && caps.supports_nax && !env_flag("VLLM_METAL_DISABLE_NAX") &&
      shape.block_size % VM_NAX_KEYS == 0) {
    l.family = "nax";
    l.kernel = nax->name;
    l.rows_per_tile = VM_NAX_ROWS;
    l.kernel_block = VM_NAX_KEYS;
    l.threads = VM_NAX_THREADS;
  } else {
    const Instance* prefill = find(f.prefill, f.n_prefill, shape.dtype, d, divisor);
    if (prefill == nullptr) no_kernel("prefill", shape);
    l.family = "prefill";
    l.kernel = prefill->name;
    l.rows_per_tile = vm_prefill_rows(bytes, d, divisor);
    l.kernel_block = vm_prefill_keys(bytes, d, divisor);
    l.threads = vm_prefill_threads(l.rows_per_tile);
  }
  for (int s : seqs) {
    const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
    const int tiles = ceil_div(q_len * group, l.rows_per_tile);
    for (int t = 0; t < tiles; ++t) {
      l.work.push_back(s);
      l.work.push_back(t);
    }
  }
  l.grid[0] = static_cast<int>(l.work.size() / 2);
  l.grid[1] = shape.num_kv_heads * (d / vm_value_columns(d));
  return l;
}

AttentionLaunch plan_decode(const AttentionShape& shape, const std::vector<int>& seqs,
                            const int32_t* seq_lens, int bytes, int divisor,
                            const DeviceCaps& caps) {
  const int d = shape.head_dim;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int rows = static_cast<int>(seqs.size());
  const Families& f = families_of(shape);
  AttentionLaunch l;
  if (group > 1 && !env_flag("VLLM_METAL_DISABLE_GQA_DECODE")) {
    const int row_tiles = ceil_div(group, VM_GQA_ROWS);
    l.family = "gqa";
    l.kernel = find(f.gqa, f.n_gqa, shape.dtype, d, divisor)->name;
    l.kernel_block = vm_gqa_keys(bytes, d, divisor);
    l.threads = VM_GQA_THREADS;
    l.grid[0] = shape.num_kv_heads * row_tiles;
    l.scratch_heads = shape.num_kv_heads * row_tiles * VM_GQA_ROWS;
  } else {
    l.family = "decode";
    l.kernel = find(f.decode, f.n_decode, shape.dtype, d, divisor)->name;
    l.kernel_block = divisor;
    l.threads = VM_DECODE_THREADS;
    l.grid[0] = shape.num_q_heads;
    l.scratch_heads = shape.num_q_heads;
  }
  l.grid[1] = rows;
  l.work.assign(seqs.begin(), seqs.end());

  int max_keys = 0;
  for (int s : seqs) {
    max_keys = std::max(max_keys, attended_keys(seq_lens[s], shape.sliding_window));
  }
  const int one_pass_groups = l.grid[0] * rows;
  if (max_keys <= VM_PARTITION_SIZE ||
      one_pass_groups >= VM_SPLIT_THREADGROUPS_PER_CORE * caps.gpu_cores) {
    l.scratch_heads = 0;
    return l;
  }
  l.partition_size = VM_PARTITION_SIZE;
  l.part_offsets.push_back(0);
  int max_parts = 1;
  for (int s : seqs) {
    const int seq_len = seq_lens[s];
    const int lo = shape.sliding_window > 0 ? std::max(0, seq_len - shape.sliding_window) : 0;
    const int base = lo - lo % VM_PARTITION_ALIGN;
    const int parts = std::max(1, ceil_div(seq_len - base, VM_PARTITION_SIZE));
    max_parts = std::max(max_parts, parts);
    l.part_offsets.push_back(l.part_offsets.back() + parts);
  }
  l.total_partitions = l.part_offsets.back();
  l.grid[2] = max_parts;
  l.reduce_kernel = find(kReduce, shape.dtype, d, 0)->name;
  l.reduce_grid[0] = shape.num_q_heads;
  l.reduce_grid[1] = rows;
  l.reduce_threads = VM_DECODE_THREADS;
  return l;
}

}  // namespace

DeviceCaps device_caps(bool supports_nax) {
  DeviceCaps caps;
  caps.supports_nax = supports_nax;
  caps.gpu_cores = device::gpu_cores();
  return caps;
}

AttentionPlan select_paged_attention_kernel(
    const AttentionShape& shape, const int32_t* cu_seqlens_q, const int32_t* seq_lens,
    int num_seqs, const DeviceCaps& caps) {
  const int bytes = dtype_bytes(shape.dtype);
  const int divisor = vm_block_divisor(shape.block_size);
  if (divisor == 0) {
    throw std::invalid_argument("paged attention: block_size " + std::to_string(shape.block_size) +
                                " is not a positive multiple of " +
                                std::to_string(VM_BLOCK_SIZE_MULTIPLE));
  }
  // A precondition (vllm_metal.ops checks it for callers), kept so the planner never divides by 0.
  if (shape.num_kv_heads <= 0 || shape.num_q_heads % shape.num_kv_heads != 0) {
    throw std::invalid_argument("paged attention: num_q_heads must be a multiple of num_kv_heads");
  }
  if (!listed_head_size(shape.head_dim)) no_kernel("attention", shape);
  const Families& f = families_of(shape);
  const bool decode_kernels =
      find(f.decode, f.n_decode, shape.dtype, shape.head_dim, divisor) != nullptr;

  std::vector<int> prefill_seqs, decode_seqs;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
    if (q_len <= 0) continue;
    if (q_len == 1 && decode_kernels) {
      decode_seqs.push_back(s);
    } else {
      prefill_seqs.push_back(s);
    }
  }
  // In a mixed batch only long decode rows get their own (split-KV capable) dispatch.
  if (!prefill_seqs.empty()) {
    std::vector<int> long_rows;
    for (int s : decode_seqs) {
      if (attended_keys(seq_lens[s], shape.sliding_window) >= VM_DECODE_SPLIT_OUT_KEYS) {
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
    plan.launches.push_back(plan_prefill(shape, prefill_seqs, cu_seqlens_q, bytes, divisor, caps));
  }
  if (!decode_seqs.empty()) {
    plan.launches.push_back(plan_decode(shape, decode_seqs, seq_lens, bytes, divisor, caps));
  }
  return plan;
}

std::vector<std::string> attention_kernel_names() {
  std::vector<std::string> names;
  append_names(names, kDecode);
  append_names(names, kReduce);
  append_names(names, kGqa);
  append_names(names, kPrefill);
  append_names(names, kNax);
  append_names(names, kDecodeFp8);
  append_names(names, kGqaFp8);
  append_names(names, kPrefillFp8);
  append_names(names, kNaxFp8);
  return names;
}

}  // namespace vllm_metal
