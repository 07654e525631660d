// Access to the project's Metal library (vllm_metal kernels) and device facts for kernel choice.
//
// macOS only: compiled into the extension when MLX is built with Metal (see CMakeLists.txt).
#pragma once

#include <string>

#include "mlx/array.h"
#include "mlx/backend/metal/device.h"

namespace vllm_metal::metal {

namespace mx = mlx::core;

// The compiled .metallib beside the extension module, loaded once into MLX's library cache.
MTL::Library* kernel_library(mx::metal::Device& d);

// Pipeline state of a kernel of that library (cached by MLX).
MTL::ComputePipelineState* kernel(mx::metal::Device& d, const std::string& name);

// M5-class GPU, an OS with Metal 4 tensor ops, and NAX kernels present in the library.
bool supports_nax(mx::metal::Device& d);

// What the kernel choice knows of the default GPU: MLX's architecture name and generation, and
// supports_nax; for logging at startup.
struct DeviceFacts {
  std::string architecture;
  int architecture_gen = 0;
  bool nax = false;
};
DeviceFacts device_facts();

// "f32", "f16", "bf16"; throws for other dtypes.
std::string dtype_tag(mx::Dtype t);

// Host-built int32 array (work lists), kept alive by the command encoder until completion.
mx::array host_int_array(const std::vector<int32_t>& values, mx::metal::CommandEncoder& enc);

// Throws std::runtime_error unless `a` satisfies `ok`, naming the op and the argument.
void require(bool ok, const char* op, const std::string& what);

}  // namespace vllm_metal::metal
