// A framework-neutral description of one array argument: the address of its first element, its
// shape and its strides in elements. The MLX primitives (array_utils.h: strided) and the DLPack
// entry points (dlpack_ops.cpp: torch tensors) both describe their arrays this way, so the
// drivers' argument builders (attention_args, write_args) are written once.
//
// Plain data only, and its helper has internal linkage: the attention kernel objects, compiled
// once per instruction set, include this through ops/attention/cpu.h (see common/elem.h).
#pragma once

#include <cstdint>

namespace vllm_metal::cpu {

struct Strided {
  static constexpr int kMaxDims = 4;
  void* data = nullptr;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

namespace {

// True when the last two axes are packed (unit last stride, and the second to last steps over one
// whole row unless it has a single entry) and no stride is negative: the KV pool layout the
// attention driver reads in place (AttentionArgs: heads D apart), whatever the block and slot
// strides.
inline bool rows_packed(const Strided& x) {
  const int n = x.ndim;
  if (n < 2 || x.strides[n - 1] != 1) return false;
  if (x.shape[n - 2] != 1 && x.strides[n - 2] != x.shape[n - 1]) return false;
  for (int i = 0; i + 2 < n; ++i) {
    if (x.strides[i] < 0) return false;
  }
  return true;
}

}  // namespace

}  // namespace vllm_metal::cpu
