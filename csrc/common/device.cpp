// GPU facts for the kernel planners (see device.h).
#include "common/device.h"

#include <atomic>

#include "constants.h"

namespace vllm_metal::device {

namespace {

std::atomic<int> g_gpu_cores{VM_DEFAULT_GPU_CORES};

}  // namespace

int gpu_cores() { return g_gpu_cores.load(std::memory_order_relaxed); }

void set_gpu_cores(int n) {
  g_gpu_cores.store(n > 0 ? n : VM_DEFAULT_GPU_CORES, std::memory_order_relaxed);
}

}  // namespace vllm_metal::device
