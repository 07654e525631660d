// Which build of the CPU attention kernel runs: the best one this CPU supports, or one chosen by
// name (_C.set_cpu_isa) for tests and benchmarks.
#pragma once

#include <string>

#include "ops/attention/cpu_kernel.h"

namespace vllm_metal::cpu {

constexpr int kIsaGeneric = 0;
constexpr int kIsaAvx2 = 1;    // AVX2 + FMA + F16C
constexpr int kIsaAvx512 = 2;  // AVX-512 F/BW/DQ/VL on top of the above

bool isa_supported(int isa);  // compiled in and supported by this CPU
int best_supported_isa();
const char* isa_name(int isa);
int active_isa();
// Selects a variant by name ("auto", "generic", "avx2", "avx512"); false if this CPU or build
// lacks it (the selection is then unchanged). Throws std::invalid_argument on an unknown name.
bool set_isa(const std::string& name);
RunItemFn kernel_for(int isa);

}  // namespace vllm_metal::cpu
