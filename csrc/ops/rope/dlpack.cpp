// rotary_embedding in place on DLPack tensors (see dlpack.h).

#include "ops/rope/dlpack.h"

#include <stdexcept>
#include <string>

#include "ops/rope/cpu.h"

namespace vllm_metal {

namespace nb = nanobind;

namespace {

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("rotary_embedding_into: " + message);
}

std::string shape_of(const nb::ndarray<>& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

void on_cpu(const char* name, const nb::ndarray<>& a) {
  if (a.device_type() != nb::device::cpu::value) {
    fail(std::string(name) + " must be a CPU tensor (DLPack device type " +
         std::to_string(a.device_type()) + ")");
  }
}

void ndim(const char* name, const nb::ndarray<>& a, size_t n, const char* layout) {
  if (a.ndim() != n) {
    fail(std::string(name) + " must have shape " + layout + " (" + std::to_string(n) +
         " dims), got shape " + shape_of(a));
  }
}

// The driver's element type of a float tensor; throws naming `name` for another dtype.
cpu::ElemType float_type(const char* name, const nb::ndarray<>& a) {
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes == 1 && dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Float)) {
    if (dt.bits == 32) return cpu::ElemType::f32;
    if (dt.bits == 16) return cpu::ElemType::f16;
  }
  if (dt.lanes == 1 && dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) &&
      dt.bits == 16) {
    return cpu::ElemType::bf16;
  }
  fail(std::string(name) + " must be float32, float16 or bfloat16 (DLPack type code " +
       std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)");
}

void last_axis_contiguous(const char* name, const nb::ndarray<>& a) {
  const size_t last = a.ndim() - 1;
  if (a.shape(last) > 1 && a.stride(last) != 1) {
    fail(std::string(name) + " must be contiguous in its last dimension (stride " +
         std::to_string(a.stride(last)) + ")");
  }
}

cpu::RopeTensor in_place(const nb::ndarray<>& a) {
  return {
      .in = a.data(),
      .out = a.data(),
      .num_heads = static_cast<int64_t>(a.shape(1)),
      .stride_token = a.stride(0),
      .stride_head = a.stride(1),
      .out_stride_token = a.stride(0),
      .out_stride_head = a.stride(1),
  };
}

}  // namespace

void rotary_embedding_into(const nb::ndarray<>& positions, const nb::ndarray<>& query,
                           const nb::ndarray<>& key, const nb::ndarray<>& cos_sin_cache,
                           bool is_neox) {
  const bool has_key = key.is_valid();
  on_cpu("positions", positions);
  on_cpu("query", query);
  if (has_key) on_cpu("key", key);
  on_cpu("cos_sin_cache", cos_sin_cache);

  ndim("positions", positions, 1, "[num_tokens]");
  const nb::dlpack::dtype pdt = positions.dtype();
  if (pdt.lanes != 1 || pdt.code != static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
      (pdt.bits != 32 && pdt.bits != 64)) {
    fail("positions must be int32 or int64");
  }
  const int64_t T = static_cast<int64_t>(positions.shape(0));

  ndim("query", query, 3, "[num_tokens, num_heads, head_size]");
  const cpu::ElemType dtype = float_type("query", query);
  const int64_t D = static_cast<int64_t>(query.shape(2));
  if (static_cast<int64_t>(query.shape(0)) != T) {
    fail("query must have shape [num_tokens = " + std::to_string(T) +
         ", num_heads, head_size], got shape " + shape_of(query));
  }
  last_axis_contiguous("query", query);
  if (has_key) {
    ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]");
    if (float_type("key", key) != dtype) fail("key must have the dtype of query");
    if (static_cast<int64_t>(key.shape(0)) != T || static_cast<int64_t>(key.shape(2)) != D) {
      fail("key must have shape [" + std::to_string(T) + ", num_kv_heads, " + std::to_string(D) +
           "], got shape " + shape_of(key));
    }
    last_axis_contiguous("key", key);
  }

  ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]");
  const cpu::ElemType cache_dtype = float_type("cos_sin_cache", cos_sin_cache);
  if (cache_dtype != dtype && cache_dtype != cpu::ElemType::f32) {
    fail("cos_sin_cache must be float32 or the dtype of query");
  }
  const int64_t max_position = static_cast<int64_t>(cos_sin_cache.shape(0));
  const int64_t rotary_dim = static_cast<int64_t>(cos_sin_cache.shape(1));
  if (rotary_dim < 2 || rotary_dim % 2 != 0 || rotary_dim > D) {
    fail("cos_sin_cache must have shape [max_position, rotary_dim] with rotary_dim even and in "
         "[2, head_size = " + std::to_string(D) + "], got shape " + shape_of(cos_sin_cache));
  }
  if (max_position < 1) fail("cos_sin_cache must have at least one row");
  last_axis_contiguous("cos_sin_cache", cos_sin_cache);

  const cpu::RopeTensor none{nullptr, nullptr, 0, 0, 0, 0, 0};
  const cpu::RopeArgs a{
      .positions = positions.data(),
      .positions_64 = pdt.bits == 64,
      .positions_stride = positions.stride(0),
      .cos_sin_cache = cos_sin_cache.data(),
      .cache_dtype = cache_dtype,
      .cache_stride = cos_sin_cache.stride(0),
      .max_position = max_position,
      .rotary_dim = rotary_dim,
      .query = in_place(query),
      .key = has_key ? in_place(key) : none,
      .dtype = dtype,
      .num_tokens = T,
      .head_size = D,
      .is_neox = is_neox,
  };
  nb::gil_scoped_release release;
  cpu::rotary_embedding(a);
}

}  // namespace vllm_metal
