// Facts about the GPU that the kernel planners need and Metal does not expose.
//
// The core count comes from the IORegistry; vllm_metal/ops/_gpu.py reads it and sets it here
// (_C.set_gpu_cores) before the first GPU dispatch. Until then VM_DEFAULT_GPU_CORES is assumed.
#pragma once

namespace vllm_metal::device {

int gpu_cores();
// n <= 0 restores the default.
void set_gpu_cores(int n);

}  // namespace vllm_metal::device
