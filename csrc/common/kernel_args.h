// Brackets for the Metal kernel argument structs, whose headers both the Metal sources and the C++
// host encoders include: in MSL they sit at global scope, on the host in vllm_metal::metal_args.
//
// Fields are plain scalars only (int = 32-bit, long_t = 64-bit, float), so a struct has the same
// layout on both sides; the host passes it with set_bytes.
#pragma once

#if defined(__METAL_VERSION__)
typedef long long_t;
#define VM_KERNEL_ARGS_BEGIN
#define VM_KERNEL_ARGS_END
#else
#include <cstdint>
#define VM_KERNEL_ARGS_BEGIN \
  namespace vllm_metal::metal_args {  \
  using long_t = int64_t;
#define VM_KERNEL_ARGS_END }
#endif
