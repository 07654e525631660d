// The DLPack entry points (see dlpack_ops.h). nanobind's ndarray takes a torch tensor through
// __dlpack__ without copying it, with its strides and dtype; each entry point checks every shape,
// dtype, device and layout relation (raising ValueError naming the argument), describes the arrays
// as Strided views and hands them to the same argument builders and drivers the MLX primitives'
// eval_cpu use (ops/attention/cpu.h, ops/cache/cpu.h), with the GIL released while they run.
//
// Unlike eval_cpu, nothing is staged here: an argument whose layout the driver cannot read in
// place is refused, so the caller sees every copy it makes.

#include "dlpack_ops.h"

#include <nanobind/ndarray.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "common/elem.h"
#include "common/strided.h"
#include "ops/attention/cpu.h"
#include "ops/attention/cpu_isa.h"
#include "ops/cache/cpu.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace vllm_metal {

namespace {

using Input = nb::ndarray<nb::ro>;  // read only (nanobind then asks for the cheaper capsule)
using Output = nb::ndarray<>;       // written in place

// Raises ValueError from one entry point's checks, each message naming the argument.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  [[noreturn]] void fail(const std::string& message) const {
    throw std::invalid_argument(std::string(op_) + ": " + message);
  }

  // The view of `a`: a CPU array of `ndim` axes.
  template <typename Array>
  cpu::Strided view(const char* name, const Array& a, int ndim, const char* layout) const {
    if (a.device_type() != nb::device::cpu::value) {
      fail(std::string(name) + " must be a CPU tensor, got DLPack device type " +
           std::to_string(a.device_type()));
    }
    if (static_cast<int>(a.ndim()) != ndim) {
      fail(std::string(name) + " must have shape " + layout + " (" + std::to_string(ndim) +
           " dims), got " + std::to_string(a.ndim()) + " dims");
    }
    cpu::Strided v;
    v.data = const_cast<void*>(static_cast<const void*>(a.data()));
    v.ndim = ndim;
    for (int i = 0; i < ndim; ++i) {
      v.shape[i] = static_cast<int64_t>(a.shape(i));
      v.strides[i] = a.stride(i);
    }
    return v;
  }

  // The driver's element type of a float array (float32, float16 or bfloat16).
  cpu::ElemType float_type(const char* name, nb::dlpack::dtype t) const {
    using Code = nb::dlpack::dtype_code;
    if (t.lanes == 1 && t.code == static_cast<uint8_t>(Code::Float) && t.bits == 32) {
      return cpu::ElemType::f32;
    }
    if (t.lanes == 1 && t.code == static_cast<uint8_t>(Code::Float) && t.bits == 16) {
      return cpu::ElemType::f16;
    }
    if (t.lanes == 1 && t.code == static_cast<uint8_t>(Code::Bfloat) && t.bits == 16) {
      return cpu::ElemType::bf16;
    }
    fail(std::string(name) + " must be float32, float16 or bfloat16, got " + dtype_name(t));
  }

  void same_dtype(const char* name, nb::dlpack::dtype t, const char* ref_name,
                  nb::dlpack::dtype ref) const {
    if (t != ref) {
      fail(std::string(name) + " dtype " + dtype_name(t) + " differs from " + ref_name +
           " dtype " + dtype_name(ref));
    }
  }

  // A contiguous array of `want` elements and `ndim` axes, of `shape` unless that is null: the
  // index and sink arrays.
  template <typename Array>
  cpu::Strided exact(const char* name, const Array& a, nb::dlpack::dtype want, int ndim,
                     const int64_t* shape, const char* layout) const {
    cpu::Strided v = view(name, a, ndim, layout);
    if (a.dtype() != want) {
      fail(std::string(name) + " must be " + dtype_name(want) + ", got " + dtype_name(a.dtype()));
    }
    if (shape != nullptr) expect_shape(name, v, shape, layout);
    contiguous(name, v);
    return v;
  }

  void expect_shape(const char* name, const cpu::Strided& v, const int64_t* shape,
                    const char* layout) const {
    for (int i = 0; i < v.ndim; ++i) {
      if (v.shape[i] != shape[i]) {
        fail(std::string(name) + " must have shape " + layout + " = " + dims(shape, v.ndim) +
             ", got " + dims(v.shape, v.ndim));
      }
    }
  }

  // Row-major without gaps (axes of one entry may have any stride).
  void contiguous(const char* name, const cpu::Strided& v) const {
    int64_t expected = 1;
    for (int i = v.ndim - 1; i >= 0; --i) {
      if (v.shape[i] == 1) continue;
      if (v.strides[i] != expected) {
        fail(std::string(name) + " must be contiguous, got shape " + dims(v.shape, v.ndim) +
             " with strides " + dims(v.strides, v.ndim));
      }
      expected *= v.shape[i];
    }
  }

  static std::string dims(const int64_t* d, int n) {
    std::string s = "(";
    for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(d[i]);
    return s + (n == 1 ? ",)" : ")");
  }

  static std::string dtype_name(nb::dlpack::dtype t) {
    using Code = nb::dlpack::dtype_code;
    std::string s;
    switch (static_cast<Code>(t.code)) {
      case Code::Int:
        s = "int";
        break;
      case Code::UInt:
        s = "uint";
        break;
      case Code::Float:
        s = "float";
        break;
      case Code::Bfloat:
        s = "bfloat";
        break;
      case Code::Bool:
        return "bool";
      default:
        s = "dtype_code";
        s += std::to_string(t.code);
        s += "_";
    }
    s += std::to_string(t.bits);
    if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
    return s;
  }

 private:
  const char* op_;
};

constexpr nb::dlpack::dtype kInt32 = nb::dtype<int32_t>();
constexpr nb::dlpack::dtype kInt64 = nb::dtype<int64_t>();
constexpr nb::dlpack::dtype kFloat32 = nb::dtype<float>();
constexpr const char* kPoolLayout = "[num_blocks, block_size, num_kv_heads, head_size]";

// Checks the two KV pools against each other; returns key_cache's view (its shape is both's).
template <typename Array>
cpu::Strided check_pools(const Checker& c, const Array& key_cache, const Array& value_cache,
                         cpu::Strided* value_view) {
  const cpu::Strided k = c.view("key_cache", key_cache, 4, kPoolLayout);
  const cpu::Strided v = c.view("value_cache", value_cache, 4, kPoolLayout);
  if (k.shape[0] <= 0 || k.shape[1] <= 0 || k.shape[2] <= 0 || k.shape[3] <= 0) {
    c.fail("key_cache must have at least one block, slot, KV head and element, got shape " +
           Checker::dims(k.shape, 4));
  }
  c.expect_shape("value_cache", v, k.shape, "key_cache's shape");
  *value_view = v;
  return k;
}

void paged_attention_into(const Output& out, const Input& query, const Input& key_cache,
                          const Input& value_cache, const Input& block_tables,
                          const Input& seq_lens, const Input& cu_seqlens_q, float scale,
                          int64_t sliding_window, float softcap, const Input& sinks) {
  const Checker c("paged_attention_into");
  const cpu::Strided q = c.view("query", query, 3, "[num_tokens, num_heads, head_size]");
  const cpu::ElemType dtype = c.float_type("query", query.dtype());
  const int64_t T = q.shape[0], Hq = q.shape[1], D = q.shape[2];
  if (Hq <= 0 || D <= 0) c.fail("query must have at least one head and element");

  cpu::Strided vc;
  const cpu::Strided kc = check_pools(c, key_cache, value_cache, &vc);
  c.same_dtype("key_cache", key_cache.dtype(), "query", query.dtype());
  c.same_dtype("value_cache", value_cache.dtype(), "query", query.dtype());
  const int64_t Hkv = kc.shape[2];
  if (kc.shape[3] != D) {
    c.fail("key_cache head_size " + std::to_string(kc.shape[3]) + " differs from query head_size " +
           std::to_string(D));
  }
  if (Hq % Hkv != 0) {
    c.fail("query num_heads (" + std::to_string(Hq) + ") must be a multiple of key_cache " +
           "num_kv_heads (" + std::to_string(Hkv) + ")");
  }
  // The driver reads the pools in place, one head's row at a time.
  auto packed = [&](const char* name, const cpu::Strided& pool) {
    if (!cpu::rows_packed(pool)) {
      c.fail(std::string(name) + " must have its heads packed (strides [any, any, head_size, " +
             "1]), got strides " + Checker::dims(pool.strides, 4));
    }
  };
  packed("key_cache", kc);
  packed("value_cache", vc);

  const cpu::Strided bt = c.exact("block_tables", block_tables, kInt32, 2, nullptr,
                                  "[num_seqs, max_blocks_per_seq]");
  const int64_t seq_shape[] = {bt.shape[0]}, cu_shape[] = {bt.shape[0] + 1};
  const cpu::Strided lens = c.exact("seq_lens", seq_lens, kInt32, 1, seq_shape, "[num_seqs]");
  const cpu::Strided cu =
      c.exact("cu_seqlens_q", cu_seqlens_q, kInt32, 1, cu_shape, "[num_seqs + 1]");
  const float* sink_data = nullptr;
  if (sinks.is_valid()) {
    const int64_t sink_shape[] = {Hq};
    sink_data = static_cast<const float*>(
        c.exact("sinks", sinks, kFloat32, 1, sink_shape, "[num_heads]").data);
  }

  const cpu::Strided o = c.view("out", out, 3, "[num_tokens, num_heads, head_size]");
  c.same_dtype("out", out.dtype(), "query", query.dtype());
  c.expect_shape("out", o, q.shape, "query's shape");
  c.contiguous("out", o);

  if (!std::isfinite(scale)) c.fail("scale must be finite, got " + std::to_string(scale));
  if (sliding_window < 0 || sliding_window > std::numeric_limits<int32_t>::max()) {
    c.fail("sliding_window must be 0 (none) or a positive int32, got " +
           std::to_string(sliding_window));
  }
  if (!(softcap >= 0.0f) || !std::isfinite(softcap)) {
    c.fail("softcap must be 0 (none) or a positive finite number, got " + std::to_string(softcap));
  }
  if (T == 0) return;

  const cpu::AttentionArgs args = cpu::attention_args(
      q, kc, vc, bt, static_cast<const int32_t*>(lens.data), static_cast<const int32_t*>(cu.data),
      sink_data, o.data, dtype, scale, static_cast<int32_t>(sliding_window), softcap);
  const int isa = cpu::active_isa();
  nb::gil_scoped_release release;
  cpu::paged_attention(args, isa);
}

void reshape_and_cache_into(const Input& key, const Input& value, const Output& key_cache,
                            const Output& value_cache, const Input& slot_mapping) {
  const Checker c("reshape_and_cache_into");
  const char* rows_layout = "[num_tokens, num_kv_heads, head_size]";
  const cpu::Strided k = c.view("key", key, 3, rows_layout);
  const cpu::Strided v = c.view("value", value, 3, rows_layout);
  c.expect_shape("value", v, k.shape, "key's shape");

  cpu::Strided vc;
  const cpu::Strided kc = check_pools(c, key_cache, value_cache, &vc);
  if (k.shape[1] != kc.shape[2] || k.shape[2] != kc.shape[3]) {
    c.fail("key rows [num_kv_heads, head_size] = " + Checker::dims(k.shape + 1, 2) +
           " do not match key_cache [num_kv_heads, head_size] = " + Checker::dims(kc.shape + 2, 2));
  }
  // Rows are copied bytewise, so any one element type of whole bytes works.
  const nb::dlpack::dtype t = key_cache.dtype();
  c.same_dtype("value_cache", value_cache.dtype(), "key_cache", t);
  c.same_dtype("key", key.dtype(), "key_cache", t);
  c.same_dtype("value", value.dtype(), "key_cache", t);
  if (t.lanes != 1 || t.bits % 8 != 0) {
    c.fail("key_cache must have whole-byte elements, got " + Checker::dtype_name(t));
  }
  const int64_t slot_shape[] = {k.shape[0]};
  const cpu::Strided slots =
      c.exact("slot_mapping", slot_mapping, kInt64, 1, slot_shape, "[num_tokens]");
  if (k.shape[0] == 0) return;

  const auto* slot_data = static_cast<const int64_t*>(slots.data);
  const cpu::CacheWriteArgs wk = cpu::write_args(k, kc, slot_data, t.bits / 8);
  const cpu::CacheWriteArgs wv = cpu::write_args(v, vc, slot_data, t.bits / 8);
  nb::gil_scoped_release release;
  cpu::reshape_and_cache(wk, wv);
}

}  // namespace

void add_dlpack_ops(nb::module_& m) {
  m.def("paged_attention_into", &paged_attention_into, "out"_a, "query"_a, "key_cache"_a,
        "value_cache"_a, "block_tables"_a, "seq_lens"_a, "cu_seqlens_q"_a, "scale"_a,
        "sliding_window"_a = 0, "softcap"_a = 0.0f, "sinks"_a.none() = nb::none(),
        "vllm_metal.ops.paged_attention's CPU body on DLPack CPU tensors (torch), writing `out` "
        "in place. query [T, Hq, D] (any strides); key_cache/value_cache [NB, BS, Hkv, D] with "
        "any block and slot strides but heads packed (strides [., ., D, 1]); block_tables "
        "[S, max_blocks], seq_lens [S] and cu_seqlens_q [S + 1] contiguous int32; sinks [Hq] "
        "contiguous float32 or None; out [T, Hq, D] contiguous in query's dtype (float32, "
        "float16 or bfloat16), not overlapping the inputs. sliding_window 0 and softcap 0 mean "
        "none. Raises ValueError naming the argument; releases the GIL while the kernel runs.");
  m.def("reshape_and_cache_into", &reshape_and_cache_into, "key"_a, "value"_a, "key_cache"_a,
        "value_cache"_a, "slot_mapping"_a,
        "vllm_metal.ops.reshape_and_cache's CPU body on DLPack CPU tensors (torch): writes row t "
        "of key/value [T, Hkv, D] (any strides) into the pools [NB, BS, Hkv, D] (any strides) at "
        "slot_mapping[t] (contiguous int64 [T]), in place; a slot < 0 or past the pools' end is "
        "skipped. Rows and pools share one dtype (copied bytewise); the pools must not overlap "
        "the rows. Raises ValueError naming the argument; releases the GIL while it writes.");
}

}  // namespace vllm_metal
