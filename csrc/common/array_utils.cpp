// Layout helpers shared by the CPU bodies (see array_utils.h).

#include "common/array_utils.h"

#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"

namespace vllm_metal::cpu {

namespace {

void copy_dim(const char* src, const std::vector<int64_t>& shape,
              const std::vector<int64_t>& strides, size_t itemsize, size_t dim, char*& dst) {
  const int64_t n = shape[dim];
  const int64_t step = strides[dim] * static_cast<int64_t>(itemsize);
  if (dim + 1 == shape.size()) {
    if (strides[dim] == 1) {
      std::memcpy(dst, src, n * itemsize);
      dst += n * itemsize;
      return;
    }
    for (int64_t i = 0; i < n; ++i, dst += itemsize) std::memcpy(dst, src + i * step, itemsize);
    return;
  }
  for (int64_t i = 0; i < n; ++i) copy_dim(src + i * step, shape, strides, itemsize, dim + 1, dst);
}

mx::array staged_copy(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  mx::array copy(x.shape(), x.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  std::vector<int64_t> shape(x.shape().begin(), x.shape().end());
  std::vector<int64_t> strides(x.strides().begin(), x.strides().end());
  encoder.dispatch([src = x.data<char>(), dst = copy.data<char>(), shape = std::move(shape),
                    strides = std::move(strides), itemsize = x.itemsize()]() {
    copy_strided(src, shape, strides, itemsize, dst);
  });
  encoder.add_temporary(copy);
  return copy;
}

}  // namespace

void copy_strided(const char* src, const std::vector<int64_t>& shape,
                  const std::vector<int64_t>& strides, size_t itemsize, char* dst) {
  if (shape.empty()) {
    std::memcpy(dst, src, itemsize);
    return;
  }
  for (int64_t n : shape) {
    if (n == 0) return;
  }
  copy_dim(src, shape, strides, itemsize, 0, dst);
}

mx::array row_contiguous(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  if (x.flags().row_contiguous) return x;
  return staged_copy(x, encoder);
}

mx::array packed_rows(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  if (x.flags().row_contiguous) return x;
  const bool packed = x.ndim() <= static_cast<size_t>(Strided::kMaxDims) && rows_packed(strided(x));
  return packed ? x : staged_copy(x, encoder);
}

Strided strided(const mx::array& x) {
  if (x.ndim() > static_cast<size_t>(Strided::kMaxDims)) {
    throw std::invalid_argument("strided: more axes than Strided::kMaxDims");
  }
  Strided v;
  v.data = const_cast<void*>(x.data<void>());
  v.ndim = static_cast<int>(x.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = x.shape(i);
    v.strides[i] = x.strides(i);
  }
  return v;
}

ElemType elem_type(mx::Dtype t) {
  if (t == mx::float16) return ElemType::f16;
  if (t == mx::bfloat16) return ElemType::bf16;
  return ElemType::f32;
}

std::vector<mx::array> stage_io(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs, mx::cpu::CommandEncoder& encoder) {
  std::vector<mx::array> in;
  for (const mx::array& x : inputs) in.push_back(row_contiguous(x, encoder));
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  for (mx::array& x : in) encoder.set_input_array(x);
  for (mx::array& out : outputs) encoder.set_output_array(out);
  return in;
}

}  // namespace vllm_metal::cpu
