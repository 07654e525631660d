// Host-side choice of the Metal kernel for each op (placeholder until the kernel family lands).
#pragma once

#include <nanobind/nanobind.h>

namespace vllm_metal {

// Adds the kernel-choice functions to the extension module (for tests and diagnostics).
void bind_kernel_select(nanobind::module_& m);

}  // namespace vllm_metal
