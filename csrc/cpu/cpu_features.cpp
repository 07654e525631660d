// Run-time detection of the instruction sets the CPU attention kernel builds can use.

#include "cpu/cpu_features.h"

namespace vllm_metal::cpu {

bool isa_supported(int isa) {
  if (isa == kIsaGeneric) return true;
#if defined(__x86_64__) && defined(VLLM_METAL_X86_VARIANTS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == kIsaAvx2) return avx2;
  if (isa == kIsaAvx512) {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
#endif
  return false;
}

int best_supported_isa() {
  if (isa_supported(kIsaAvx512)) return kIsaAvx512;
  if (isa_supported(kIsaAvx2)) return kIsaAvx2;
  return kIsaGeneric;
}

}  // namespace vllm_metal::cpu
