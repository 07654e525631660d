// Python bindings of vllm_metal._C: one def per op, the Metal planners (for tests and diagnostics),
// the shared constants, runtime knobs, and build facts the loader checks.

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "common/device.h"
#if defined(VLLM_METAL_WITH_METAL)
#include "common/metal_library.h"
#endif
#include "common/thread_pool.h"
#include "constants.h"
#include "dlpack_ops.h"
#include "mlx/version.h"
#include "ops/attention/cpu_isa.h"
#include "ops/attention/op.h"
#include "ops/attention/plan.h"
#include "ops/cache/op.h"
#include "ops/cache/plan.h"
#include "ops/gated_delta/op.h"
#include "ops/gated_delta/plan.h"
#include "ops/mamba2/op.h"
#include "ops/mamba2/plan.h"
#include "ops/mla/op.h"
#include "ops/mla/plan.h"
#include "ops/rope/dlpack.h"
#include "ops/rope/op.h"
#include "ops/rope/plan.h"
#include "ops/short_conv/dlpack.h"
#include "ops/short_conv/op.h"
#include "ops/short_conv/plan.h"
#include "ops/turboquant/bindings.h"
#include "ops/turboquant/plan.h"

namespace nb = nanobind;
using namespace nb::literals;

#define VM_STR2(x) #x
#define VM_STR(x) VM_STR2(x)

namespace {

namespace vm = vllm_metal;

// Every constant of constants.h, keyed by its name without the VM_ prefix; list entries of one
// field become ints, entries of several fields tuples (identifiers as strings).
nb::dict constants() {
  nb::dict c;
#define VM_NUMBER_(NAME) c[#NAME] = VM_##NAME;
#define VM_INT_(V, L) L.append(V);
#define VM_PAIR_(A, B, L) L.append(nb::make_tuple(A, B));
#define VM_DTYPE_(DT, T, NAME, BYTES, L) L.append(nb::make_tuple(#DT, #T, #NAME, BYTES));
#define VM_FP8_(NAME, ID, M, BIAS, MAX, FN, L) \
  L.append(nb::make_tuple(#NAME, ID, M, BIAS, MAX, FN));
#define VM_PTH_(NAME, ID, L) L.append(nb::make_tuple(#NAME, ID));
#define VM_LIST_(NAME, ENTRY)  \
  {                            \
    nb::list l;                \
    VM_##NAME(ENTRY, l)        \
    c[#NAME] = nb::tuple(l);   \
  }
  VM_NUMBER_(OPS_ABI)
  VM_NUMBER_(BLOCK_SIZE_MULTIPLE)
  VM_NUMBER_(SIMD_WIDTH)
  VM_NUMBER_(THREADGROUP_MEMORY_BYTES)
  VM_NUMBER_(MAX_VALUE_COLUMNS)
  VM_NUMBER_(DECODE_THREADS)
  VM_NUMBER_(GQA_THREADS)
  VM_NUMBER_(GQA_ROWS)
  VM_NUMBER_(NAX_ROWS)
  VM_NUMBER_(NAX_KEYS)
  VM_NUMBER_(NAX_THREADS)
  VM_NUMBER_(CACHE_MAX_THREADS)
  VM_NUMBER_(GATED_DELTA_ROWS)
  VM_NUMBER_(GATED_DELTA_MAX_KEY_DIM)
  VM_NUMBER_(SHORT_CONV_MAX_THREADS)
  VM_NUMBER_(MAMBA2_ROWS)
  VM_NUMBER_(MAMBA2_MAX_STATE_DIM)
  VM_NUMBER_(MLA_HEADS)
  VM_NUMBER_(MLA_MAX_KEYS)
  VM_NUMBER_(ROPE_MAX_THREADS)
  VM_NUMBER_(PARTITION_SIZE)
  VM_NUMBER_(PARTITION_ALIGN)
  VM_NUMBER_(SPLIT_THREADGROUPS_PER_CORE)
  VM_NUMBER_(DEFAULT_GPU_CORES)
  VM_NUMBER_(DECODE_SPLIT_OUT_KEYS)
  VM_NUMBER_(KV_FORMAT_SAME)
  VM_NUMBER_(FP8_NAN_CODE)
  VM_NUMBER_(PTH_SCALE_BYTES)
  VM_NUMBER_(TQ_GROUP_HEADS)
  VM_NUMBER_(TQ_MIN_PARTITION)
  VM_LIST_(HALF_DTYPES, VM_DTYPE_)
  VM_LIST_(FLOAT_DTYPES, VM_DTYPE_)
  VM_LIST_(DECODE_HEAD_SIZES, VM_INT_)
  VM_LIST_(WIDE_HEAD_SIZES, VM_INT_)
  VM_LIST_(HEAD_SIZES, VM_INT_)
  VM_LIST_(BLOCK_DIVISORS, VM_INT_)
  VM_LIST_(PREFILL_TILES, VM_PAIR_)
  VM_LIST_(MLA_SIZES, VM_PAIR_)
  VM_LIST_(FP8_FORMATS, VM_FP8_)
  VM_LIST_(PTH_FORMATS, VM_PTH_)
  VM_LIST_(TQ_HEAD_SIZES, VM_INT_)
#undef VM_NUMBER_
#undef VM_INT_
#undef VM_PAIR_
#undef VM_DTYPE_
#undef VM_FP8_
#undef VM_PTH_
#undef VM_LIST_
  return c;
}

std::vector<int> triple(const int (&v)[3]) { return {v[0], v[1], v[2]}; }

// A one-kernel launch (gated_delta_rule, causal_conv1d, mamba2_scan) as a dict.
template <typename Launch>
nb::dict simple_launch(const Launch& l) {
  nb::dict d;
  d["kernel"] = l.kernel;
  d["threads"] = l.threads;
  d["grid"] = triple(l.grid);
  return d;
}

nb::dict launch_to_dict(const vm::AttentionLaunch& l) {
  nb::dict d;
  d["family"] = l.family;
  d["kernel"] = l.kernel;
  d["grid"] = triple(l.grid);
  d["threads"] = l.threads;
  d["rows_per_tile"] = l.rows_per_tile;
  d["kernel_block"] = l.kernel_block;
  d["work"] = l.work;
  d["partition_size"] = l.partition_size;
  d["part_offsets"] = l.part_offsets;
  d["total_partitions"] = l.total_partitions;
  d["scratch_heads"] = l.scratch_heads;
  d["reduce_kernel"] = l.reduce_kernel;
  d["reduce_grid"] = triple(l.reduce_grid);
  d["reduce_threads"] = l.reduce_threads;
  return d;
}

nb::dict plan_paged_attention(const std::string& dtype, int num_q_heads, int num_kv_heads,
                              int head_dim, int block_size,
                              const std::vector<int32_t>& cu_seqlens_q,
                              const std::vector<int32_t>& seq_lens, int sliding_window,
                              bool supports_nax, std::optional<int> gpu_cores,
                              const std::string& kv_cache_dtype) {
  if (cu_seqlens_q.size() != seq_lens.size() + 1) {
    throw std::invalid_argument("cu_seqlens_q must have len(seq_lens) + 1 entries");
  }
  vm::AttentionShape shape;
  shape.dtype = dtype;
  shape.fp8_pools = vm::cpu::kv_format_of(kv_cache_dtype, "select_paged_attention_kernel") !=
                    vm::cpu::KvFormat::same;
  shape.num_q_heads = num_q_heads;
  shape.num_kv_heads = num_kv_heads;
  shape.head_dim = head_dim;
  shape.block_size = block_size;
  shape.sliding_window = sliding_window;
  vm::DeviceCaps caps = vm::device_caps(supports_nax);
  if (gpu_cores.has_value()) caps.gpu_cores = *gpu_cores;
  const vm::AttentionPlan plan = vm::select_paged_attention_kernel(
      shape, cu_seqlens_q.data(), seq_lens.data(), static_cast<int>(seq_lens.size()), caps);
  nb::list launches;
  for (const auto& l : plan.launches) launches.append(launch_to_dict(l));
  nb::dict out;
  out["launches"] = launches;
  return out;
}

}  // namespace

NB_MODULE(_C, m) {
  namespace mx = mlx::core;
  m.doc() =
      "Native ops of vllm-metal (MLX primitives): paged KV-cache writes, paged attention, the "
      "gated delta rule, the causal short convolution, the Mamba-2 scan and multi-head latent "
      "attention (with its latent-cache write).";

  m.attr("MLX_VERSION") = VM_STR(MLX_VERSION_MAJOR) "." VM_STR(MLX_VERSION_MINOR) "." VM_STR(
      MLX_VERSION_PATCH);
  m.attr("NANOBIND_VERSION") = VM_STR(NB_VERSION_MAJOR) "." VM_STR(NB_VERSION_MINOR) "." VM_STR(
      NB_VERSION_PATCH);
  m.attr("OPS_ABI") = VM_OPS_ABI;
  m.attr("CONSTANTS") = constants();
#if defined(VLLM_METAL_WITH_METAL)
  m.attr("HAS_METAL") = true;
#else
  m.attr("HAS_METAL") = false;
#endif

  m.def("mlx_runtime_version", [] { return std::string(mx::version()); },
        "Version string of the libmlx this module is linked against.");
  m.def(
      "uncommitted_bytes",
      [](const std::vector<int>& shape) {
        // The allocator's buffer, never written here: the OS backs a page once it is first
        // written (a fresh mmap on Linux, a Metal buffer's virtual memory on macOS).
        size_t nbytes = 1;
        for (int d : shape) {
          if (d < 0) throw std::invalid_argument("uncommitted_bytes: negative dimension");
          nbytes *= static_cast<size_t>(d);
        }
        return mx::array(mx::allocator::malloc(nbytes), mx::Shape(shape.begin(), shape.end()),
                         mx::uint8);
      },
      "shape"_a,
      "A uint8 array of that shape whose memory is allocated but not written, so its pages are "
      "committed only as they are first written (a reused cached buffer may already be). Its "
      "contents are undefined.");
  m.def("_abi_probe", [](const mx::array& a) { return a.ndim(); }, "a"_a,
        "Returns a.ndim; fails with TypeError when this module cannot see MLX's array type.");

  // The ops, unvalidated: vllm_metal.ops checks the arguments and states the semantics.
  m.def("reshape_and_cache", &vm::reshape_and_cache, "key"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a, nb::kw_only(), "kv_cache_dtype"_a = "auto",
        "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "stream"_a = nb::none(),
        "vllm_metal.ops.reshape_and_cache without argument checks (kv_cache_dtype: auto, "
        "fp8_e4m3, fp8_e5m2). Returns (key_cache, value_cache), which share the pools' memory.");
  m.def("paged_attention", &vm::paged_attention, "query"_a, "key_cache"_a, "value_cache"_a,
        "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a, nb::kw_only(), "scale"_a,
        "sliding_window"_a = nb::none(), "softcap"_a = nb::none(), "sinks"_a = nb::none(),
        "kv_cache_dtype"_a = "auto", "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
        "stream"_a = nb::none(),
        "vllm_metal.ops.paged_attention without argument checks (kv_cache_dtype: auto, "
        "fp8_e4m3, fp8_e5m2).");
  m.def("gated_delta_rule", &vm::gated_delta_rule, "q"_a, "k"_a, "v"_a, "g"_a, "beta"_a,
        "state"_a, "cu_seqlens"_a, nb::kw_only(), "stream"_a = nb::none(),
        "vllm_metal.ops.gated_delta_rule without argument checks. Returns (y, state).");
  m.def("causal_conv1d", &vm::causal_conv1d, "x"_a, "weight"_a, "conv_state"_a, "cu_seqlens"_a,
        "bias"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "vllm_metal.ops.causal_conv1d without argument checks. Returns (y, conv_state).");
  m.def("mamba2_scan", &vm::mamba2_scan, "x"_a, "dt"_a, "A"_a, "B"_a, "C"_a, "D"_a, "state"_a,
        "cu_seqlens"_a, nb::kw_only(), "stream"_a = nb::none(),
        "vllm_metal.ops.mamba2_scan without argument checks. Returns (y, state).");
  m.def("mla_attention", &vm::mla_attention, "query"_a, "latent_cache"_a, "block_tables"_a,
        "seq_lens"_a, "cu_seqlens_q"_a, nb::kw_only(), "scale"_a, "value_dim"_a,
        "stream"_a = nb::none(), "vllm_metal.ops.mla_attention without argument checks.");
  m.def("mla_reshape_and_cache", &vm::mla_reshape_and_cache, "latent"_a, "latent_cache"_a,
        "slot_mapping"_a, nb::kw_only(), "stream"_a = nb::none(),
        "vllm_metal.ops.mla_reshape_and_cache without argument checks. Returns latent_cache, "
        "which shares the pool's memory.");
  m.def("rotary_embedding", &vm::rotary_embedding, "positions"_a, "query"_a, "key"_a,
        "cos_sin_cache"_a, "is_neox"_a, nb::kw_only(), "stream"_a = nb::none(),
        "vllm_metal.ops.rotary_embedding without argument checks. Returns (query, key).");
  m.def("rotary_embedding_into", &vm::rotary_embedding_into, "positions"_a, "query"_a,
        "key"_a.none(), "cos_sin_cache"_a, "is_neox"_a,
        "Rotates query [T, Hq, D] and key [T, Hkv, D] (or None) in place, as "
        "vllm_metal.ops.rotary_embedding computes them: DLPack CPU tensors (torch, NumPy), any "
        "token/head strides, read zero-copy; checks the arguments (ValueError naming one); "
        "releases the GIL.");
  m.def("causal_conv1d_into", &vm::causal_conv1d_into, "x"_a, "weight"_a, "bias"_a.none(),
        "conv_state"_a, "state_indices"_a, "has_state"_a.none(), "cu_seqlens"_a, "out"_a,
        "silu"_a,
        "The causal depthwise convolution of each sequence of x [T, C] (cu_seqlens) continued "
        "from its window conv_state[state_indices[s]] (zeros where has_state is false), written "
        "into out, the new windows stored back in place (SiLU when silu): DLPack CPU tensors "
        "(torch, NumPy) read zero-copy; checks the arguments (ValueError naming one); releases "
        "the GIL.");
  // The CPU bodies of paged_attention and reshape_and_cache on DLPack tensors (the torch backend),
  // checked here since no Python layer validates for them.
  vm::add_dlpack_ops(m);

  // The Metal planners: plain shapes in, plain dicts out (no GPU needed).
  m.def("select_paged_attention_kernel", &plan_paged_attention, "dtype"_a, "num_q_heads"_a,
        "num_kv_heads"_a, "head_dim"_a, "block_size"_a, "cu_seqlens_q"_a, "seq_lens"_a,
        "sliding_window"_a = 0, "supports_nax"_a = false, "gpu_cores"_a = nb::none(),
        "kv_cache_dtype"_a = "auto",
        "Kernel plan of one paged-attention call: {'launches': [dispatch dicts]}. gpu_cores=None "
        "plans for this device's cores (set_gpu_cores); kv_cache_dtype fp8_e4m3 / fp8_e5m2: "
        "uint8 pools (the _fp8 instances).");
  m.def(
      "select_reshape_and_cache_kernel",
      [](const std::string& dtype, int num_kv_heads, int head_dim,
         const std::string& kv_cache_dtype) {
        const bool fp8 = vm::cpu::kv_format_of(kv_cache_dtype, "select_reshape_and_cache_kernel") !=
                         vm::cpu::KvFormat::same;
        const vm::CacheLaunch c =
            vm::select_reshape_and_cache_kernel(dtype, num_kv_heads, head_dim, fp8);
        nb::dict d;
        d["kernel"] = c.kernel;
        d["threads"] = c.threads;
        return d;
      },
      "dtype"_a, "num_kv_heads"_a, "head_dim"_a, "kv_cache_dtype"_a = "auto",
      "Kernel and threadgroup size of one reshape_and_cache call (dtype: the rows'; "
      "kv_cache_dtype fp8_e4m3 / fp8_e5m2: uint8 pools).");
  m.def(
      "select_gated_delta_rule_kernel",
      [](const std::string& dtype, int num_v_heads, int key_dim, int value_dim, int num_seqs) {
        return simple_launch(
            vm::select_gated_delta_rule_kernel(dtype, num_v_heads, key_dim, value_dim, num_seqs));
      },
      "dtype"_a, "num_v_heads"_a, "key_dim"_a, "value_dim"_a, "num_seqs"_a,
      "Kernel, threadgroup size and grid of one gated_delta_rule call.");
  m.def(
      "select_causal_conv1d_kernel",
      [](const std::string& dtype, int num_tokens, int num_seqs, int channels, int width) {
        return simple_launch(
            vm::select_causal_conv1d_kernel(dtype, num_tokens, num_seqs, channels, width));
      },
      "dtype"_a, "num_tokens"_a, "num_seqs"_a, "channels"_a, "width"_a,
      "Kernel, threadgroup size and grid of one causal_conv1d call.");
  m.def(
      "select_mamba2_scan_kernel",
      [](const std::string& dtype, int num_heads, int head_dim, int state_dim, int num_seqs) {
        return simple_launch(
            vm::select_mamba2_scan_kernel(dtype, num_heads, head_dim, state_dim, num_seqs));
      },
      "dtype"_a, "num_heads"_a, "head_dim"_a, "state_dim"_a, "num_seqs"_a,
      "Kernel, threadgroup size and grid of one mamba2_scan call.");
  m.def(
      "select_mla_attention_kernel",
      [](const std::string& dtype, int num_heads, int latent_dim, int value_dim, int num_tokens) {
        const vm::MlaLaunch l =
            vm::select_mla_attention_kernel(dtype, num_heads, latent_dim, value_dim, num_tokens);
        nb::dict d = simple_launch(l);
        d["keys"] = l.keys;
        return d;
      },
      "dtype"_a, "num_heads"_a, "latent_dim"_a, "value_dim"_a, "num_tokens"_a,
      "Kernel, threadgroup size, grid and latent rows per tile of one mla_attention call.");
  m.def(
      "select_mla_reshape_and_cache_kernel",
      [](const std::string& dtype, int latent_dim, int num_tokens) {
        return simple_launch(
            vm::select_mla_reshape_and_cache_kernel(dtype, latent_dim, num_tokens));
      },
      "dtype"_a, "latent_dim"_a, "num_tokens"_a,
      "Kernel, threadgroup size and grid of one mla_reshape_and_cache call.");
  m.def(
      "select_rotary_embedding_kernel",
      [](const std::string& dtype, const std::string& cache_dtype,
         const std::string& positions_dtype, int num_tokens, int num_heads, int head_size) {
        return simple_launch(vm::select_rotary_embedding_kernel(
            dtype, cache_dtype, positions_dtype, num_tokens, num_heads, head_size));
      },
      "dtype"_a, "cache_dtype"_a, "positions_dtype"_a, "num_tokens"_a, "num_heads"_a,
      "head_size"_a,
      "Kernel, threadgroup size and grid of one rotary_embedding call (num_heads: query and key "
      "heads together; positions_dtype 'i32' or 'i64').");
  m.def(
      "all_kernel_names",
      [] {
        std::vector<std::string> names = vm::cache_kernel_names();
        for (auto& n : vm::attention_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::gated_delta_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::short_conv_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::mamba2_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::mla_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::rope_kernel_names()) names.push_back(std::move(n));
        for (auto& n : vm::turboquant_kernel_names()) names.push_back(std::move(n));
        return names;
      },
      "Every Metal kernel name the host can request (the instances of constants.h).");

  vm::bind_turboquant(m);

  // Runtime knobs.
  m.def("gpu_cores", &vm::device::gpu_cores, "GPU cores the split-KV plan assumes.");
  m.def("set_gpu_cores", &vm::device::set_gpu_cores, "n"_a,
        "Sets the GPU cores the split-KV plan assumes (n <= 0: the default).");
  m.def("nax_eligible", &vm::device::nax_eligible, "os_has_metal4"_a, "architecture"_a,
        "architecture_gen"_a,
        "Whether a GPU of that MLX architecture name and generation, on an OS with Metal 4 "
        "tensors or not, can run the NAX kernels (the rule the GPU build applies).");
#if defined(VLLM_METAL_WITH_METAL)
  m.def(
      "metal_device_facts",
      [] {
        const vm::metal::DeviceFacts f = vm::metal::device_facts();
        nb::dict d;
        d["architecture"] = f.architecture;
        d["architecture_gen"] = f.architecture_gen;
        d["nax"] = f.nax;
        return d;
      },
      "The default GPU as the kernel choice sees it: {'architecture', 'architecture_gen', "
      "'nax'}.");
#endif
  m.def("num_threads", [] { return vm::cpu::ThreadPool::instance().num_threads(); },
        "Threads the CPU bodies use.");
  m.def("set_num_threads", [](int n) { vm::cpu::ThreadPool::instance().set_num_threads(n); },
        "n"_a, "Sets the threads the CPU bodies use (n <= 0: the CPUs this process may use).");
  m.def("use_host_openmp",
        [](bool on) { return vm::cpu::ThreadPool::instance().use_host_openmp(on); }, "on"_a,
        "Runs the CPU bodies on the team of the GNU OpenMP runtime this process already loaded "
        "(torch's) instead of the extension's threads; returns whether they now do.");
  m.def("host_openmp", [] { return vm::cpu::ThreadPool::instance().host_openmp(); },
        "Whether the CPU bodies run on the process's OpenMP team (use_host_openmp).");
  m.def("cpu_isa", [] { return std::string(vm::cpu::isa_name(vm::cpu::active_isa())); },
        "The build of the CPU attention kernel in use: generic, avx2 or avx512.");
  m.def("set_cpu_isa", &vm::cpu::set_isa, "name"_a,
        "Selects the CPU attention kernel build (auto, generic, avx2, avx512); returns False when "
        "this CPU or build lacks it.");
}
