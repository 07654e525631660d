// The Python bindings of the TurboQuant ops (unvalidated: vllm_metal/ops/turboquant/ checks the
// arguments and states the semantics) and of their Metal planner.

#include "ops/turboquant/bindings.h"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "common/device.h"
#include "ops/turboquant/op.h"
#include "ops/turboquant/plan.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace vllm_metal {

void bind_turboquant(nb::module_& m) {
  m.def("turboquant_write", &turboquant_write, "key"_a, "key_norm"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a, "centroids"_a, nb::kw_only(), "key_bits"_a,
        "value_bits"_a, "stream"_a = nb::none(),
        "vllm_metal.ops.turboquant.reshape_and_cache's write of prepared rows, without argument "
        "checks. Returns (key_cache, value_cache), which share the pools' memory.");
  m.def("turboquant_attention", &turboquant_attention, "query"_a, "key_cache"_a,
        "value_cache"_a, "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a, "centroids"_a,
        nb::kw_only(), "key_bits"_a, "value_bits"_a, "norm_correction"_a, "scale"_a,
        "sliding_window"_a = nb::none(), "softcap"_a = nb::none(), "sinks"_a = nb::none(),
        "stream"_a = nb::none(),
        "Paged attention over TurboQuant pools, every key read from the cache, without argument "
        "checks (query rotated, float32; returns float32).");
  m.def(
      "select_turboquant_write_kernel",
      [](int num_tokens, int num_kv_heads) {
        const TqWriteLaunch l = select_turboquant_write_kernel(num_tokens, num_kv_heads);
        nb::dict d;
        d["kernel"] = l.kernel;
        d["grid"] = nb::make_tuple(l.grid, 1, 1);
        d["threads"] = l.threads;
        return d;
      },
      "num_tokens"_a, "num_kv_heads"_a, "Kernel, grid and threadgroup size of one write.");
  m.def(
      "select_turboquant_attention_kernel",
      [](int head_dim, int num_q_heads, int num_kv_heads, int num_tokens,
         const std::vector<int32_t>& cu_seqlens_q, const std::vector<int32_t>& seq_lens,
         int sliding_window, std::optional<int> gpu_cores) {
        if (cu_seqlens_q.size() != seq_lens.size() + 1) {
          throw std::invalid_argument("cu_seqlens_q must have len(seq_lens) + 1 entries");
        }
        const TqAttentionLaunch l = select_turboquant_attention_kernel(
            head_dim, num_q_heads, num_kv_heads, num_tokens, cu_seqlens_q.data(),
            seq_lens.data(), static_cast<int>(seq_lens.size()), sliding_window,
            gpu_cores.value_or(device::gpu_cores()));
        nb::dict d;
        d["kernel"] = l.kernel;
        d["grid"] = nb::make_tuple(l.grid[0], l.grid[1], l.grid[2]);
        d["threads"] = l.threads;
        d["reduce_kernel"] = l.reduce_kernel;
        d["reduce_grid"] = nb::make_tuple(l.reduce_grid[0], l.reduce_grid[1], l.reduce_grid[2]);
        d["reduce_threads"] = l.reduce_threads;
        d["head_chunks"] = l.head_chunks;
        d["partition_size"] = l.partition_size;
        d["num_partitions"] = l.num_partitions;
        d["work"] = l.work;
        return d;
      },
      "head_dim"_a, "num_q_heads"_a, "num_kv_heads"_a, "num_tokens"_a, "cu_seqlens_q"_a,
      "seq_lens"_a, "sliding_window"_a = 0, "gpu_cores"_a = nb::none(),
      "The Metal plan of one TurboQuant attention call: kernels, grids, the split-KV partition "
      "and the work list (each token's sequence, -1 for padding).");
}

}  // namespace vllm_metal
