// The planner of the TurboQuant Metal dispatches (see plan.h and
// metal_kernels/turboquant/decode.metal for what each grid axis means).
#include "ops/turboquant/plan.h"

#include <algorithm>
#include <stdexcept>

#include "constants.h"

namespace vllm_metal {

namespace {

bool served(int head_dim) {
#define VM_TQ_IS_(D, ...) \
  if (head_dim == D) return true;
  VM_TQ_HEAD_SIZES(VM_TQ_IS_, )
#undef VM_TQ_IS_
  return false;
}

std::string decode_name(int head_dim) {
#define VM_TQ_NAME_(D, ...) \
  if (head_dim == D) return VM_KERNEL_NAME_TQ_DECODE(D);
  VM_TQ_HEAD_SIZES(VM_TQ_NAME_, )
#undef VM_TQ_NAME_
  return {};
}

std::string reduce_name(int head_dim) {
#define VM_TQ_NAME_(D, ...) \
  if (head_dim == D) return VM_KERNEL_NAME_TQ_REDUCE(D);
  VM_TQ_HEAD_SIZES(VM_TQ_NAME_, )
#undef VM_TQ_NAME_
  return {};
}

}  // namespace

TqWriteLaunch select_turboquant_write_kernel(int num_tokens, int num_kv_heads) {
  TqWriteLaunch l;
  l.kernel = VM_KERNEL_NAME_TQ_WRITE;
  l.threads = VM_SIMD_WIDTH;
  l.grid = std::max(1, (num_tokens * num_kv_heads + l.threads - 1) / l.threads);
  return l;
}

TqAttentionLaunch select_turboquant_attention_kernel(int head_dim, int num_q_heads,
                                                     int num_kv_heads, int num_tokens,
                                                     const int32_t* cu_seqlens_q,
                                                     const int32_t* seq_lens, int num_seqs,
                                                     int sliding_window, int gpu_cores) {
  if (!served(head_dim)) {
    throw std::invalid_argument("turboquant attention: no Metal kernel for head_dim " +
                                std::to_string(head_dim) + " (VM_TQ_HEAD_SIZES of constants.h)");
  }
  TqAttentionLaunch l;
  l.kernel = decode_name(head_dim);
  l.threads = VM_SIMD_WIDTH;
  const int group = num_q_heads / num_kv_heads;
  l.head_chunks = (group + VM_TQ_GROUP_HEADS - 1) / VM_TQ_GROUP_HEADS;
  l.work.assign(static_cast<size_t>(std::max(num_tokens, 0)), -1);
  int longest = 0;  // the most keys one row attends
  for (int s = 0; s < num_seqs; ++s) {
    const int c0 = std::clamp(cu_seqlens_q[s], 0, num_tokens);
    const int c1 = std::clamp(cu_seqlens_q[s + 1], c0, num_tokens);
    for (int t = c0; t < c1; ++t) l.work[t] = s;
    const int span = sliding_window > 0 ? std::min(seq_lens[s], sliding_window) : seq_lens[s];
    if (c1 > c0) longest = std::max(longest, span);
  }
  l.grid[0] = std::max(num_tokens, 1);
  l.grid[1] = num_kv_heads * l.head_chunks;
  // Split-KV: few threadgroups over long rows leave cores idle; aim at
  // VM_SPLIT_THREADGROUPS_PER_CORE per core, partitions of at least VM_TQ_MIN_PARTITION keys.
  const int groups = l.grid[0] * l.grid[1];
  const int target = std::max(1, gpu_cores) * VM_SPLIT_THREADGROUPS_PER_CORE;
  const int want = (target + groups - 1) / groups;
  const int most = longest / VM_TQ_MIN_PARTITION;
  const int parts = std::clamp(want, 1, std::max(most, 1));
  if (parts > 1) {
    const int size = (longest + parts - 1) / parts;
    l.partition_size = (size + VM_SIMD_WIDTH - 1) / VM_SIMD_WIDTH * VM_SIMD_WIDTH;
    l.num_partitions = (longest + l.partition_size - 1) / l.partition_size;
    l.grid[2] = l.num_partitions;
    l.reduce_kernel = reduce_name(head_dim);
    l.reduce_grid[0] = l.grid[0];
    l.reduce_grid[1] = num_q_heads;
    l.reduce_threads = VM_SIMD_WIDTH;
  }
  return l;
}

std::vector<std::string> turboquant_kernel_names() {
  std::vector<std::string> names = {VM_KERNEL_NAME_TQ_WRITE};
#define VM_TQ_NAMES_(D, ...)                        \
  names.push_back(VM_KERNEL_NAME_TQ_DECODE(D));     \
  names.push_back(VM_KERNEL_NAME_TQ_REDUCE(D));
  VM_TQ_HEAD_SIZES(VM_TQ_NAMES_, )
#undef VM_TQ_NAMES_
  return names;
}

}  // namespace vllm_metal
