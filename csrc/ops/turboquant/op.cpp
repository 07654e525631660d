// The TurboQuant ops: builders and eval_cpu, which hand plain pointers to the drivers (cpu.h).

#include "ops/turboquant/op.h"

#include <memory>
#include <stdexcept>
#include <string>

#include "common/array_utils.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/cache/op.h"  // bind_output_pool

namespace vllm_metal {

namespace {

cpu::TqFormat format_of(int key_bits, int value_bits, bool norm_correction) {
  const bool keys_ok = key_bits == 8 || key_bits == 3 || key_bits == 4;
  if (!keys_ok || (value_bits != 3 && value_bits != 4)) {
    throw std::invalid_argument("turboquant: key_bits must be 3, 4 or 8 and value_bits 3 or 4");
  }
  return {key_bits, value_bits, norm_correction};
}

cpu::TqPool pool_of(const mx::array& pool) {
  if (pool.strides(3) != 1) {
    throw std::invalid_argument("turboquant: a pool row's bytes must be contiguous");
  }
  return {const_cast<uint8_t*>(pool.data<uint8_t>()), pool.strides(0), pool.strides(1),
          pool.strides(2)};
}

}  // namespace

std::pair<mx::array, mx::array> turboquant_write(
    const mx::array& key, const mx::array& key_norm, const mx::array& value,
    const mx::array& key_cache, const mx::array& value_cache, const mx::array& slot_mapping,
    const mx::array& centroids, int key_bits, int value_bits, mx::StreamOrDevice s) {
  const cpu::TqFormat format = format_of(key_bits, value_bits, false);
  if (key_cache.dtype() != mx::uint8 || value_cache.dtype() != mx::uint8 ||
      key.dtype() != mx::float32 || value.dtype() != mx::float32) {
    throw std::invalid_argument("turboquant_write: float32 rows into uint8 pools");
  }
  auto stream = mx::to_stream(s);
  auto outputs = mx::array::make_arrays(
      {key_cache.shape(), value_cache.shape()}, {mx::uint8, mx::uint8},
      std::make_shared<TurboQuantWrite>(stream, format),
      {key, mx::astype(key_norm, mx::float32, stream), value, key_cache, value_cache,
       slot_mapping, mx::astype(centroids, mx::float32, stream)});
  return {outputs[0], outputs[1]};
}

mx::array turboquant_attention(const mx::array& query, const mx::array& key_cache,
                               const mx::array& value_cache, const mx::array& block_tables,
                               const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                               const mx::array& centroids, int key_bits, int value_bits,
                               bool norm_correction, float scale,
                               std::optional<int> sliding_window, std::optional<float> softcap,
                               std::optional<mx::array> sinks, mx::StreamOrDevice s) {
  const cpu::TqFormat format = format_of(key_bits, value_bits, norm_correction);
  if (key_cache.dtype() != mx::uint8 || value_cache.dtype() != mx::uint8 ||
      query.dtype() != mx::float32) {
    throw std::invalid_argument("turboquant_attention: a float32 query over uint8 pools");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {query, key_cache, value_cache, block_tables, seq_lens,
                                   cu_seqlens_q, mx::astype(centroids, mx::float32, stream)};
  if (sinks.has_value()) inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  auto primitive = std::make_shared<TurboQuantAttention>(
      stream, format, scale, sliding_window.value_or(0), softcap.value_or(0.0f),
      sinks.has_value());
  return mx::array(query.shape(), mx::float32, std::move(primitive), std::move(inputs));
}

metal_args::TurboQuantWriteParams turboquant_write_metal_args(
    const TurboQuantWrite& op, const std::vector<mx::array>& inputs) {
  const mx::array& key = inputs[0];
  const mx::array& kc = inputs[3];
  const mx::array& vc = inputs[4];
  return {
      .num_rows = key.shape(0) * key.shape(1),
      .num_kv_heads = key.shape(1),
      .head_dim = key.shape(2),
      .block_size = kc.shape(1),
      .num_slots = static_cast<int64_t>(kc.shape(0)) * kc.shape(1),
      .kc_stride_block = kc.strides(0),
      .kc_stride_slot = kc.strides(1),
      .kc_stride_head = kc.strides(2),
      .vc_stride_block = vc.strides(0),
      .vc_stride_slot = vc.strides(1),
      .vc_stride_head = vc.strides(2),
      .key_bits = op.format.key_bits,
      .value_bits = op.format.value_bits,
  };
}

metal_args::TurboQuantAttentionParams turboquant_attention_metal_args(
    const TurboQuantAttention& op, const std::vector<mx::array>& inputs) {
  const mx::array& query = inputs[0];
  const mx::array& kc = inputs[1];
  const mx::array& vc = inputs[2];
  return {
      .num_tokens = query.shape(0),
      .num_q_heads = query.shape(1),
      .num_kv_heads = kc.shape(2),
      .head_dim = query.shape(2),
      .num_blocks = kc.shape(0),
      .block_size = kc.shape(1),
      .max_blocks_per_seq = inputs[3].shape(1),
      .kc_stride_block = kc.strides(0),
      .kc_stride_slot = kc.strides(1),
      .kc_stride_head = kc.strides(2),
      .vc_stride_block = vc.strides(0),
      .vc_stride_slot = vc.strides(1),
      .vc_stride_head = vc.strides(2),
      .scale = op.scale,
      .softcap = op.softcap,
      .sliding_window = op.sliding_window,
      .has_sinks = op.has_sinks ? 1 : 0,
      .key_bits = op.format.key_bits,
      .value_bits = op.format.value_bits,
      .norm_correction = op.format.norm_correction ? 1 : 0,
      .head_chunks = 1,
      .partition_size = 0,
      .num_partitions = 1,
  };
}

void TurboQuantWrite::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  mx::array key = cpu::row_contiguous(inputs[0], encoder);
  mx::array norm = cpu::row_contiguous(inputs[1], encoder);
  mx::array value = cpu::row_contiguous(inputs[2], encoder);
  mx::array slots = cpu::row_contiguous(inputs[5], encoder);
  mx::array centroids = cpu::row_contiguous(inputs[6], encoder);
  bind_output_pool(inputs[3], outputs[0], encoder);
  bind_output_pool(inputs[4], outputs[1], encoder);
  if (key.size() == 0) return;
  cpu::TqWriteArgs w{
      .key = key.data<float>(),
      .key_norm = norm.data<float>(),
      .value = value.data<float>(),
      .centroids = centroids.data<float>(),
      .key_cache = pool_of(outputs[0]),
      .value_cache = pool_of(outputs[1]),
      .slots = slots.data<int64_t>(),
      .num_tokens = key.shape(0),
      .num_heads = key.shape(1),
      .head_dim = key.shape(2),
      .block_size = outputs[0].shape(1),
      .num_slots = static_cast<int64_t>(outputs[0].shape(0)) * outputs[0].shape(1),
      .format = format,
  };
  encoder.set_input_array(key);
  encoder.set_input_array(norm);
  encoder.set_input_array(value);
  encoder.set_input_array(slots);
  encoder.set_input_array(centroids);
  encoder.set_output_array(outputs[0]);
  encoder.set_output_array(outputs[1]);
  encoder.dispatch([w]() { cpu::turboquant_write(w); });
}

void TurboQuantAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  mx::array query = cpu::row_contiguous(inputs[0], encoder);
  mx::array key_cache = cpu::packed_rows(inputs[1], encoder);
  mx::array value_cache = cpu::packed_rows(inputs[2], encoder);
  mx::array block_tables = cpu::row_contiguous(inputs[3], encoder);
  mx::array seq_lens = cpu::row_contiguous(inputs[4], encoder);
  mx::array cu_seqlens_q = cpu::row_contiguous(inputs[5], encoder);
  mx::array centroids = cpu::row_contiguous(inputs[6], encoder);
  std::optional<mx::array> sinks;
  if (has_sinks) sinks = cpu::row_contiguous(inputs[7], encoder);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  cpu::TqAttentionArgs a{
      .query = query.data<float>(),
      .key_cache = pool_of(key_cache),
      .value_cache = pool_of(value_cache),
      .block_tables = block_tables.data<int32_t>(),
      .seq_lens = seq_lens.data<int32_t>(),
      .cu_seqlens_q = cu_seqlens_q.data<int32_t>(),
      .sinks = sinks ? sinks->data<float>() : nullptr,
      .centroids = centroids.data<float>(),
      .out = out.data<float>(),
      .num_tokens = query.shape(0),
      .num_seqs = block_tables.shape(0),
      .num_q_heads = query.shape(1),
      .num_kv_heads = key_cache.shape(2),
      .head_dim = query.shape(2),
      .num_blocks = key_cache.shape(0),
      .block_size = key_cache.shape(1),
      .max_blocks = block_tables.shape(1),
      .scale = scale,
      .sliding_window = sliding_window,
      .softcap = softcap,
      .format = format,
  };
  for (const mx::array& a_in : {query, key_cache, value_cache, block_tables, seq_lens,
                                cu_seqlens_q, centroids}) {
    encoder.set_input_array(a_in);
  }
  if (sinks) encoder.set_input_array(*sinks);
  encoder.set_output_array(out);
  if (a.num_tokens == 0) return;
  encoder.dispatch([a]() { cpu::turboquant_attention(a); });
}

#if !defined(VLLM_METAL_WITH_METAL)
// Builds without Metal: only the CPU bodies run (as ops/no_metal.cpp says for the other ops).
void TurboQuantWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("vllm_metal._C: turboquant_write has no Metal kernels in this build");
}
void TurboQuantAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error(
      "vllm_metal._C: turboquant_attention has no Metal kernels in this build");
}
#endif

}  // namespace vllm_metal
