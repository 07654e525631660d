// rotary_embedding: the op builder and eval_cpu, which hands the inputs' own memory and strides to
// the driver (staging a copy only for an input whose last axis is not contiguous).

#include "ops/rope/op.h"

#include <memory>

#include "common/array_utils.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/rope/cpu.h"

namespace vllm_metal {

namespace {

// `x` itself when its last axis is contiguous (or has one element), else a row-contiguous copy.
mx::array unit_last_stride(const mx::array& x, mx::cpu::CommandEncoder& encoder) {
  if (x.ndim() == 0 || x.shape(-1) <= 1 || x.strides(-1) == 1) return x;
  return cpu::row_contiguous(x, encoder);
}

cpu::RopeTensor rope_tensor(const mx::array& in, mx::array& out) {
  return {
      .in = in.data<void>(),
      .out = out.data<void>(),
      .num_heads = in.shape(1),
      .stride_token = in.strides(0),
      .stride_head = in.strides(1),
      .out_stride_token = out.strides(0),
      .out_stride_head = out.strides(1),
  };
}

}  // namespace

std::pair<mx::array, mx::array> rotary_embedding(const mx::array& positions,
                                                 const mx::array& query, const mx::array& key,
                                                 const mx::array& cos_sin_cache, bool is_neox,
                                                 mx::StreamOrDevice s) {
  auto outputs = mx::array::make_arrays(
      {query.shape(), key.shape()}, {query.dtype(), query.dtype()},
      std::make_shared<RotaryEmbedding>(mx::to_stream(s), is_neox),
      {positions, query, key, cos_sin_cache});
  return {outputs[0], outputs[1]};
}

metal_args::RotaryEmbeddingParams rotary_embedding_metal_args(
    const RotaryEmbedding& op, const std::vector<mx::array>& inputs) {
  const mx::array& query = inputs[1];
  const mx::array& key = inputs[2];
  const mx::array& cache = inputs[3];
  return {
      .num_tokens = query.shape(0),
      .num_q_heads = query.shape(1),
      .num_kv_heads = key.shape(1),
      .head_size = query.shape(2),
      .rotary_dim = cache.shape(1),
      .max_position = cache.shape(0),
      .is_neox = op.is_neox ? 1 : 0,
      .pad0 = 0,
      .q_stride_token = query.strides(0),
      .q_stride_head = query.strides(1),
      .q_stride_dim = query.strides(2),
      .k_stride_token = key.strides(0),
      .k_stride_head = key.strides(1),
      .k_stride_dim = key.strides(2),
  };
}

void RotaryEmbedding::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array& positions = inputs[0];  // read through its stride
  const mx::array query = unit_last_stride(inputs[1], encoder);
  const mx::array key = unit_last_stride(inputs[2], encoder);
  const mx::array cache = unit_last_stride(inputs[3], encoder);
  for (mx::array& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const mx::array* x : {&positions, &query, &key, &cache}) encoder.set_input_array(*x);
  for (mx::array& out : outputs) encoder.set_output_array(out);

  const cpu::RopeArgs a{
      .positions = positions.data<void>(),
      .positions_64 = positions.dtype() == mx::int64,
      .positions_stride = positions.strides(0),
      .cos_sin_cache = cache.data<void>(),
      .cache_dtype = cpu::elem_type(cache.dtype()),
      .cache_stride = cache.strides(0),
      .max_position = cache.shape(0),
      .rotary_dim = cache.shape(1),
      .query = rope_tensor(query, outputs[0]),
      .key = rope_tensor(key, outputs[1]),
      .dtype = cpu::elem_type(query.dtype()),
      .num_tokens = query.shape(0),
      .head_size = query.shape(2),
      .is_neox = is_neox,
  };
  encoder.dispatch([a]() { cpu::rotary_embedding(a); });
}

}  // namespace vllm_metal
