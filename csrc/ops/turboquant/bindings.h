// The Python bindings of the TurboQuant ops and planners (called from csrc/bindings.cpp).
#pragma once

#include <nanobind/nanobind.h>

namespace vllm_metal {

void bind_turboquant(nanobind::module_& m);

}  // namespace vllm_metal
