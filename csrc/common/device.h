// Facts about the GPU that the kernel planners need and Metal does not expose.
//
// The core count comes from the IORegistry; vllm_metal/ops/_gpu.py reads it and sets it here
// (_C.set_gpu_cores) before the first GPU dispatch. Until then VM_DEFAULT_GPU_CORES is assumed.
#pragma once

#include <string>

namespace vllm_metal::device {

int gpu_cores();
// n <= 0 restores the default.
void set_gpu_cores(int n);

// Whether a GPU can run the NAX kernels (Metal 4 tensor ops on the neural accelerators): the OS
// has Metal 4 tensors, and the GPU is generation 17 or later (18 for phone-class parts, whose
// architecture name, as MLX reports it, ends in 'p'). The library must also hold the kernels,
// which the caller checks.
bool nax_eligible(bool os_has_metal4, const std::string& architecture, int architecture_gen);

}  // namespace vllm_metal::device
