// Layout helpers shared by the CPU bodies: strided copies, contiguous staging of inputs, and the
// eval_cpu prologue of ops that write new buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "common/elem.h"
#include "common/strided.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace vllm_metal::cpu {

namespace mx = mlx::core;

// Copies the elements of a strided array (shape/strides in elements) into row-major `dst`.
void copy_strided(const char* src, const std::vector<int64_t>& shape,
                  const std::vector<int64_t>& strides, size_t itemsize, char* dst);

// Returns `x` when it is row-contiguous; otherwise a new row-contiguous array whose copy is
// enqueued on `encoder` (so it runs before anything dispatched later on the stream).
mx::array row_contiguous(const mx::array& x, mx::cpu::CommandEncoder& encoder);

// Like row_contiguous, but only requires the last two axes to be packed (rows_packed of
// common/strided.h), so pools sliced out of a larger allocation are used in place.
mx::array packed_rows(const mx::array& x, mx::cpu::CommandEncoder& encoder);

// The framework-neutral view of an evaluated array (at most Strided::kMaxDims axes; throws
// std::invalid_argument for more).
Strided strided(const mx::array& x);

// The CPU drivers' element type for an MLX float dtype (float16, bfloat16, else float32).
ElemType elem_type(mx::Dtype t);

// The eval_cpu prologue of an op whose outputs are new buffers: stages every input row-contiguous
// (row_contiguous), gives each output a new buffer, registers both with `encoder`, and returns the
// staged inputs.
std::vector<mx::array> stage_io(const std::vector<mx::array>& inputs,
                                std::vector<mx::array>& outputs, mx::cpu::CommandEncoder& encoder);

}  // namespace vllm_metal::cpu
