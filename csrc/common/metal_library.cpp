// Loading of the vllm_metal .metallib and the device checks shared by the eval_gpu bodies.
#include "common/metal_library.h"

#include <dlfcn.h>

#include <filesystem>
#include <stdexcept>

#include "common/device.h"
#include "constants.h"

namespace vllm_metal::metal {

namespace {

// Candidates next to the extension: setup.py's build_metallib output, then the CMake target's.
std::string find_metallib() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&find_metallib), &info) == 0 || info.dli_fname == nullptr) {
    throw std::runtime_error("vllm_metal: cannot locate the extension module on disk");
  }
  const std::filesystem::path dir = std::filesystem::path(info.dli_fname).parent_path();
  std::vector<std::filesystem::path> candidates = {dir / "lib" / "vllm_metal.metallib"};
#ifdef VLLM_METAL_METALLIB_NAME
  candidates.push_back(dir / (std::string(VLLM_METAL_METALLIB_NAME) + ".metallib"));
#endif
  for (const auto& c : candidates) {
    if (std::filesystem::exists(c)) return c.string();
  }
  throw std::runtime_error("vllm_metal: no Metal kernel library next to " + dir.string() +
                           " (expected lib/vllm_metal.metallib); reinstall a macOS build");
}

}  // namespace

MTL::Library* kernel_library(mx::metal::Device& d) {
  static const std::string path = find_metallib();
  return d.get_library("vllm_metal_kernels", path);
}

MTL::ComputePipelineState* kernel(mx::metal::Device& d, const std::string& name) {
  return d.get_kernel(name, kernel_library(d));
}

bool supports_nax(mx::metal::Device& d) {
  static const bool supported = [&d] {
    bool os_ok = false;
    if (__builtin_available(macOS 26.2, iOS 26.2, *)) {
      os_ok = true;
    }
    if (!device::nax_eligible(os_ok, d.get_architecture(), d.get_architecture_gen())) {
      return false;
    }
    auto* fname = NS::String::string(VM_KERNEL_NAME_NAX(f16, 128), NS::UTF8StringEncoding);
    MTL::Function* f = kernel_library(d)->newFunction(fname);
    if (f == nullptr) return false;  // library built without Metal 4
    f->release();
    return true;
  }();
  return supported;
}

DeviceFacts device_facts() {
  auto& d = mx::metal::device(mx::Device::gpu);
  return DeviceFacts{d.get_architecture(), d.get_architecture_gen(), supports_nax(d)};
}

std::string dtype_tag(mx::Dtype t) {
  if (t == mx::float32) return "f32";
  if (t == mx::float16) return "f16";
  if (t == mx::bfloat16) return "bf16";
  throw std::runtime_error("vllm_metal: Metal kernels support float32, float16 and bfloat16");
}

mx::array host_int_array(const std::vector<int32_t>& values, mx::metal::CommandEncoder& enc) {
  std::vector<int32_t> v = values.empty() ? std::vector<int32_t>{0} : values;
  mx::array a(v.begin(), mx::Shape{static_cast<int>(v.size())}, mx::int32);
  enc.add_temporary(a);
  return a;
}

void require(bool ok, const char* op, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(std::string("vllm_metal.") + op + " on the GPU: " + what);
  }
}

}  // namespace vllm_metal::metal
