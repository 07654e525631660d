#include "kernel_select.h"

namespace vllm_metal {

void bind_kernel_select(nanobind::module_& m) { (void)m; }

}  // namespace vllm_metal
