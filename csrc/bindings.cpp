// Python bindings of vllm_metal._C: one def per op, plus build facts the loader checks.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include <string>

#include "cpu/cpu_features.h"
#include "cpu/thread_pool.h"
#include "kernel_select.h"
#include "mlx/version.h"
#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;

#define VM_STR2(x) #x
#define VM_STR(x) VM_STR2(x)

// Bumped whenever ops.h or the semantics of an op change, so a stale build is detected.
#define VLLM_METAL_OPS_ABI 1

NB_MODULE(_C, m) {
  namespace vm = vllm_metal;
  namespace mx = mlx::core;
  m.doc() = "Native ops of vllm-metal (MLX primitives): paged KV-cache writes and paged attention.";

  m.attr("MLX_VERSION") = VM_STR(MLX_VERSION_MAJOR) "." VM_STR(MLX_VERSION_MINOR) "." VM_STR(
      MLX_VERSION_PATCH);
  m.attr("NANOBIND_VERSION") = VM_STR(NB_VERSION_MAJOR) "." VM_STR(NB_VERSION_MINOR) "." VM_STR(
      NB_VERSION_PATCH);
  m.attr("OPS_ABI") = VLLM_METAL_OPS_ABI;
#if defined(VLLM_METAL_WITH_METAL)
  m.attr("HAS_METAL") = true;
#else
  m.attr("HAS_METAL") = false;
#endif

  m.def("mlx_runtime_version", [] { return std::string(mx::version()); },
        "Version string of the libmlx this module is linked against.");
  m.def("_abi_probe", [](const mx::array& a) { return a.ndim(); }, "a"_a,
        "Returns a.ndim; fails with TypeError when this module cannot see MLX's array type.");

  m.def("reshape_and_cache", &vm::reshape_and_cache, "key"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Writes key/value rows [T, H_kv, D] into the paged pools at slot_mapping (int64 [T], "
        "negative = skip). Returns (key_cache, value_cache), which share the pools' memory.");

  m.def("paged_attention", &vm::paged_attention, "query"_a, "key_cache"_a, "value_cache"_a,
        "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a, nb::kw_only(), "scale"_a,
        "sliding_window"_a = nb::none(), "softcap"_a = nb::none(), "sinks"_a = nb::none(),
        "stream"_a = nb::none(),
        "Varlen causal attention of packed queries [T, Hq, D] over paged K/V pools.");

  m.def("num_threads", [] { return vm::cpu::ThreadPool::instance().num_threads(); },
        "Threads the CPU bodies use.");
  m.def("set_num_threads", [](int n) { vm::cpu::ThreadPool::instance().set_num_threads(n); },
        "n"_a, "Sets the threads the CPU bodies use (n <= 0: the CPUs this process may use).");
  m.def("cpu_isa", [] { return std::string(vm::cpu::isa_name(vm::cpu::active_isa())); },
        "The build of the CPU attention kernel in use: generic, avx2 or avx512.");
  m.def("set_cpu_isa", &vm::cpu::set_isa, "name"_a,
        "Selects the CPU attention kernel build (auto, generic, avx2, avx512); returns False when "
        "this CPU or build lacks it.");

  vm::bind_kernel_select(m);
}
