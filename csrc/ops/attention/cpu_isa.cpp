// Run-time choice of the CPU attention kernel build (see cpu_isa.h).

#include "ops/attention/cpu_isa.h"

#include <atomic>
#include <stdexcept>

namespace vllm_metal::cpu {

namespace {

std::atomic<int> g_isa{-1};

}  // namespace

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

const char* isa_name(int isa) {
  switch (isa) {
    case kIsaAvx512:
      return "avx512";
    case kIsaAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

int active_isa() {
  int isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = best_supported_isa();
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return isa;
}

bool set_isa(const std::string& name) {
  int isa;
  if (name == "auto") {
    isa = best_supported_isa();
  } else if (name == "generic") {
    isa = kIsaGeneric;
  } else if (name == "avx2") {
    isa = kIsaAvx2;
  } else if (name == "avx512") {
    isa = kIsaAvx512;
  } else {
    throw std::invalid_argument("unknown CPU kernel variant '" + name +
                                "' (expected auto, generic, avx2 or avx512)");
  }
  if (!isa_supported(isa)) return false;
  g_isa.store(isa, std::memory_order_relaxed);
  return true;
}

RunItemFn kernel_for(int isa) {
#if defined(__x86_64__) && defined(VLLM_METAL_X86_VARIANTS)
  if (isa == kIsaAvx512) return run_item_avx512;
  if (isa == kIsaAvx2) return run_item_avx2;
#endif
  (void)isa;
  return run_item_generic;
}

}  // namespace vllm_metal::cpu
