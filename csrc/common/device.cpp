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

bool nax_eligible(bool os_has_metal4, const std::string& architecture, int architecture_gen) {
  if (!os_has_metal4 || architecture.empty()) return false;
  const int first_gen = architecture.back() == 'p' ? 18 : 17;
  return architecture_gen >= first_gen;
}

}  // namespace vllm_metal::device
