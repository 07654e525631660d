// The DLPack entry points of vllm_metal._C: the CPU paged-attention and KV-cache-write drivers on
// any framework's CPU tensors (torch through nanobind's ndarray), read and written in place.
#pragma once

#include <nanobind/nanobind.h>

namespace vllm_metal {

// Adds paged_attention_into and reshape_and_cache_into to the module.
void add_dlpack_ops(nanobind::module_& m);

}  // namespace vllm_metal
