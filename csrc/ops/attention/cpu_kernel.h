// Plain-data interface between the CPU paged-attention driver (cpu.cpp) and its inner kernels.
//
// cpu_kernel.cpp is compiled once per instruction-set level (generic, and on x86-64 also an
// AVX2/FMA/F16C and an AVX-512 build); the driver picks one at run time from the CPU's features
// (cpu_isa.h). Only plain structs and functions cross this boundary, so no inline or template
// code is shared between differently-compiled objects.
#pragma once

#include <cstdint>

#include "ops/attention/cpu.h"

namespace vllm_metal::cpu {

// One unit of work: packed query tokens [q_begin, q_end) of sequence `seq` (token q_begin sits at
// position pos_begin) for the KV heads [kv_begin, kv_end) and every query head reading them,
// restricted to key positions [k_begin, k_end) (already clipped to what the block table can
// address). With partial >= 0 the item is one split of a longer key range: it writes its
// unnormalised output and (running max, sum) per row to the partial buffers instead of `out`,
// and the driver merges the splits and adds the sinks.
// Rows are ordered (token, KV head, query head in the group): r = (i * nh + hk) * G + g.
struct WorkItem {
  int32_t seq;
  int32_t kv_begin, kv_end;
  int32_t q_begin, q_end;
  int32_t pos_begin;
  int32_t k_begin, k_end;
  int32_t partial;
};

// Keys handled per tile (the online softmax is updated once per tile).
constexpr int kKeyTile = 32;

// Per-thread scratch, sized by the driver for at most `max_rows` query rows, `max_heads` KV heads
// per item and head_dim D. Buffers are 64-byte aligned.
struct Scratch {
  float* q;     // [max_rows, D]
  float* o;     // [max_rows, D]
  float* m;     // [max_rows]
  float* l;     // [max_rows]
  float* p;     // [max_rows, kKeyTile]
  float* zero;  // [max_heads, D] zeros (stand-in rows for out-of-range block ids)
  int32_t* token_lo;  // [max tokens per item]
  int32_t* token_hi;  // [max tokens per item]
};

// partial_o: [rows, D] and partial_ml: [rows, 2] for this item when item.partial >= 0.
using RunItemFn = void (*)(const AttentionArgs&, const WorkItem&, const Scratch&, float* partial_o,
                           float* partial_ml);

void run_item_generic(const AttentionArgs&, const WorkItem&, const Scratch&, float*, float*);
#if defined(__x86_64__)
void run_item_avx2(const AttentionArgs&, const WorkItem&, const Scratch&, float*, float*);
void run_item_avx512(const AttentionArgs&, const WorkItem&, const Scratch&, float*, float*);
#endif

}  // namespace vllm_metal::cpu
