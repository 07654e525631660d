// rotary_embedding in place on DLPack tensors (torch CPU tensors, NumPy arrays) through nanobind,
// zero-copy: the entry a torch custom op calls. It checks the arguments itself (errors name them)
// and runs the CPU driver (cpu.h) with the GIL released.
#pragma once

#include <nanobind/ndarray.h>

namespace vllm_metal {

// positions [T] int32/int64, query [T, Hq, D], key [T, Hkv, D] or None (query's dtype: float32,
// float16 or bfloat16), cos_sin_cache [max_position, rotary_dim] (float32 or query's dtype):
// rotates query and key in place, as vllm_metal.ops.rotary_embedding computes them (positions
// clamped to [0, max_position - 1]). Any token/head strides; the last axis of query, key and
// cos_sin_cache must be contiguous; query and key must not overlap. CPU tensors only. Throws
// std::invalid_argument (ValueError) naming the argument.
void rotary_embedding_into(const nanobind::ndarray<>& positions, const nanobind::ndarray<>& query,
                           const nanobind::ndarray<>& key, const nanobind::ndarray<>& cos_sin_cache,
                           bool is_neox);

}  // namespace vllm_metal
