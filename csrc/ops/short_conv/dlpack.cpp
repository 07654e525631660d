// causal_conv1d over a pool of windows on DLPack tensors (see dlpack.h).

#include "ops/short_conv/dlpack.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ops/short_conv/cpu.h"

namespace vllm_metal {

namespace nb = nanobind;

namespace {

using Code = nb::dlpack::dtype_code;

[[noreturn]] void fail(const std::string& message) {
  throw std::invalid_argument("causal_conv1d_into: " + message);
}

std::string shape_of(const nb::ndarray<>& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// `a` is a CPU array of `n` axes.
void expect(const char* name, const nb::ndarray<>& a, size_t n, const char* layout) {
  if (a.device_type() != nb::device::cpu::value) {
    fail(std::string(name) + " must be a CPU tensor (DLPack device type " +
         std::to_string(a.device_type()) + ")");
  }
  if (a.ndim() != n) {
    fail(std::string(name) + " must have shape " + layout + " (" + std::to_string(n) +
         " dims), got shape " + shape_of(a));
  }
}

void dims(const char* name, const nb::ndarray<>& a, std::initializer_list<int64_t> want) {
  size_t i = 0;
  for (int64_t d : want) {
    if (static_cast<int64_t>(a.shape(i++)) != d) {
      std::string w = "(";
      size_t k = 0;
      for (int64_t v : want) w += (k++ ? ", " : "") + std::to_string(v);
      fail(std::string(name) + " must have shape " + w + (want.size() == 1 ? ",)" : ")") +
           ", got shape " + shape_of(a));
    }
  }
}

// Whether `a` is laid out row-major without gaps (strides of size-1 axes ignored).
bool contiguous(const nb::ndarray<>& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<int64_t>(a.shape(i));
  }
  return true;
}

void require_contiguous(const char* name, const nb::ndarray<>& a) {
  if (!contiguous(a)) fail(std::string(name) + " must be contiguous");
}

cpu::ElemType float_type(const char* name, const nb::ndarray<>& a) {
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes == 1 && dt.code == static_cast<uint8_t>(Code::Float)) {
    if (dt.bits == 32) return cpu::ElemType::f32;
    if (dt.bits == 16) return cpu::ElemType::f16;
  }
  if (dt.lanes == 1 && dt.code == static_cast<uint8_t>(Code::Bfloat) && dt.bits == 16) {
    return cpu::ElemType::bf16;
  }
  fail(std::string(name) + " must be float32, float16 or bfloat16 (DLPack type code " +
       std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)");
}

void same_dtype(const char* name, const nb::ndarray<>& a, cpu::ElemType dtype) {
  if (float_type(name, a) != dtype) fail(std::string(name) + " must have the dtype of x");
}

void int32_vector(const char* name, const nb::ndarray<>& a, int64_t n, const char* layout) {
  expect(name, a, 1, layout);
  const nb::dlpack::dtype dt = a.dtype();
  if (dt.lanes != 1 || dt.code != static_cast<uint8_t>(Code::Int) || dt.bits != 32) {
    fail(std::string(name) + " must be int32");
  }
  dims(name, a, {n});
  require_contiguous(name, a);
}

// The bytes [begin, end) an array's elements span.
std::pair<const char*, const char*> span(const nb::ndarray<>& a, size_t itemsize) {
  const char* p = static_cast<const char*>(a.data());
  int64_t last = 0;
  for (size_t i = 0; i < a.ndim(); ++i) {
    if (a.shape(i) == 0) return {p, p};
    last += (static_cast<int64_t>(a.shape(i)) - 1) * a.stride(i);
  }
  return {p, p + (last + 1) * static_cast<int64_t>(itemsize)};
}

bool overlap(const nb::ndarray<>& a, const nb::ndarray<>& b, size_t itemsize) {
  const auto [a0, a1] = span(a, itemsize);
  const auto [b0, b1] = span(b, itemsize);
  return a0 < b1 && b0 < a1;
}

}  // namespace

void causal_conv1d_into(const nb::ndarray<>& x, const nb::ndarray<>& weight,
                        const nb::ndarray<>& bias, const nb::ndarray<>& conv_state,
                        const nb::ndarray<>& state_indices, const nb::ndarray<>& has_state,
                        const nb::ndarray<>& cu_seqlens, const nb::ndarray<>& out, bool silu) {
  expect("x", x, 2, "[num_tokens, channels]");
  const cpu::ElemType dtype = float_type("x", x);
  const int64_t T = static_cast<int64_t>(x.shape(0)), C = static_cast<int64_t>(x.shape(1));
  require_contiguous("x", x);

  expect("weight", weight, 2, "[channels, kernel_size]");
  same_dtype("weight", weight, dtype);
  const int64_t K = static_cast<int64_t>(weight.shape(1));
  if (static_cast<int64_t>(weight.shape(0)) != C || K < 2) {
    fail("weight must have shape [" + std::to_string(C) + ", kernel_size >= 2], got shape " +
         shape_of(weight));
  }
  require_contiguous("weight", weight);

  const bool has_bias = bias.is_valid();
  if (has_bias) {
    expect("bias", bias, 1, "[channels]");
    same_dtype("bias", bias, dtype);
    dims("bias", bias, {C});
    require_contiguous("bias", bias);
  }

  expect("conv_state", conv_state, 3, "[num_windows, kernel_size - 1, channels]");
  same_dtype("conv_state", conv_state, dtype);
  const int64_t N = static_cast<int64_t>(conv_state.shape(0));
  if (static_cast<int64_t>(conv_state.shape(1)) != K - 1 ||
      static_cast<int64_t>(conv_state.shape(2)) != C) {
    fail("conv_state must have shape [num_windows, " + std::to_string(K - 1) + ", " +
         std::to_string(C) + "], got shape " + shape_of(conv_state));
  }
  if ((C > 1 && conv_state.stride(2) != 1) || (K > 2 && conv_state.stride(1) != C)) {
    fail("conv_state must have contiguous windows (strides [any, " + std::to_string(C) +
         ", 1]), got strides [" + std::to_string(conv_state.stride(0)) + ", " +
         std::to_string(conv_state.stride(1)) + ", " + std::to_string(conv_state.stride(2)) + "]");
  }
  const int64_t window_stride = conv_state.stride(0);
  if (N > 1 && window_stride < (K - 1) * C) {
    fail("conv_state's windows must not overlap (stride " + std::to_string(window_stride) +
         " < " + std::to_string((K - 1) * C) + " elements)");
  }

  expect("state_indices", state_indices, 1, "[num_seqs]");
  const int64_t S = static_cast<int64_t>(state_indices.shape(0));
  int32_vector("state_indices", state_indices, S, "[num_seqs]");
  int32_vector("cu_seqlens", cu_seqlens, S + 1, "[num_seqs + 1]");

  const bool has_flags = has_state.is_valid();
  if (has_flags) {
    expect("has_state", has_state, 1, "[num_seqs]");
    const nb::dlpack::dtype dt = has_state.dtype();
    const bool byte = dt.lanes == 1 && dt.bits == 8 &&
                      (dt.code == static_cast<uint8_t>(Code::Bool) ||
                       dt.code == static_cast<uint8_t>(Code::UInt));
    if (!byte) fail("has_state must be bool or uint8");
    dims("has_state", has_state, {S});
    require_contiguous("has_state", has_state);
  }

  expect("out", out, 2, "[num_tokens, channels]");
  same_dtype("out", out, dtype);
  dims("out", out, {T, C});
  require_contiguous("out", out);

  const size_t itemsize = dtype == cpu::ElemType::f32 ? 4 : 2;
  if (overlap(out, x, itemsize)) fail("out must not overlap x");
  if (overlap(out, conv_state, itemsize)) fail("out must not overlap conv_state");
  if (overlap(x, conv_state, itemsize)) fail("x must not overlap conv_state");

  const int32_t* indices = static_cast<const int32_t*>(state_indices.data());
  std::vector<int32_t> sorted(indices, indices + S);
  std::sort(sorted.begin(), sorted.end());
  if (S > 0 && (sorted.front() < 0 || sorted.back() >= N)) {
    fail("state_indices must be in [0, " + std::to_string(N) + "), got " +
         std::to_string(sorted.front() < 0 ? sorted.front() : sorted.back()));
  }
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    fail("state_indices must be distinct (each sequence owns its window)");
  }

  cpu::ShortConvArgs a{
      .x = x.data(),
      .weight = weight.data(),
      .conv_state = conv_state.data(),
      .cu_seqlens = static_cast<const int32_t*>(cu_seqlens.data()),
      .bias = has_bias ? bias.data() : nullptr,
      .out = out.data(),
      .state_out = conv_state.data(),
      .dtype = dtype,
      .num_tokens = T,
      .num_seqs = S,
      .channels = C,
      .width = K,
      .state_indices = indices,
      .has_state = has_flags ? static_cast<const uint8_t*>(has_state.data()) : nullptr,
      .state_stride = window_stride,
      .state_out_stride = window_stride,
      .silu = silu,
  };
  if (N <= 1) a.state_stride = a.state_out_stride = (K - 1) * C;  // any stride of one window
  nb::gil_scoped_release release;
  cpu::causal_conv1d(a);
}

}  // namespace vllm_metal
