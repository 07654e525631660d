// paged_attention: the op builder and eval_cpu, which hands plain pointers to the CPU driver.

#include "ops/attention/op.h"

#include <memory>
#include <stdexcept>
#include <utility>

#include "common/array_utils.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "ops/attention/cpu.h"
#include "ops/attention/cpu_isa.h"

namespace vllm_metal {

mx::array paged_attention(const mx::array& query, const mx::array& key_cache,
                          const mx::array& value_cache, const mx::array& block_tables,
                          const mx::array& seq_lens, const mx::array& cu_seqlens_q, float scale,
                          std::optional<int> sliding_window, std::optional<float> softcap,
                          std::optional<mx::array> sinks, const std::string& kv_cache_dtype,
                          float k_scale, float v_scale, mx::StreamOrDevice s) {
  const cpu::KvFormat kv_format = cpu::kv_format_of(kv_cache_dtype, "paged_attention");
  // The kernels read the pools as the query's dtype or, for fp8, as uint8 bytes. vllm_metal.ops
  // checks dtypes before it calls here; this guard stays so that no caller can have fp8 bytes or
  // any other mismatched pool read as floats.
  const mx::Dtype pool_dtype = kv_format == cpu::KvFormat::same ? query.dtype() : mx::uint8;
  if (key_cache.dtype() != pool_dtype || value_cache.dtype() != pool_dtype) {
    throw std::invalid_argument(
        "paged_attention: key_cache and value_cache must have the query's dtype, or be uint8 "
        "with an fp8 kv_cache_dtype (fp8 pools are read as fp8, never as floats)");
  }
  auto stream = mx::to_stream(s);
  std::vector<mx::array> inputs = {query, key_cache, value_cache, block_tables, seq_lens,
                                   cu_seqlens_q};
  if (sinks.has_value()) inputs.push_back(mx::astype(*sinks, mx::float32, stream));
  auto primitive =
      std::make_shared<PagedAttention>(stream, scale, sliding_window.value_or(0),
                                       softcap.value_or(0.0f), sinks.has_value(), kv_format,
                                       k_scale, v_scale);
  return mx::array(query.shape(), query.dtype(), std::move(primitive), std::move(inputs));
}

metal_args::PagedAttentionParams paged_attention_metal_args(const PagedAttention& op,
                                                            const std::vector<mx::array>& inputs) {
  const mx::array& query = inputs[0];
  const mx::array& key_cache = inputs[1];
  return {
      .num_seqs = inputs[4].shape(0),
      .num_q_heads = query.shape(1),
      .num_kv_heads = key_cache.shape(2),
      .num_blocks = key_cache.shape(0),
      .block_size = key_cache.shape(1),
      .max_blocks_per_seq = inputs[3].shape(1),
      .q_stride_token = query.strides(0),
      .q_stride_head = query.strides(1),
      .kv_stride_block = key_cache.strides(0),
      .kv_stride_slot = key_cache.strides(1),
      .kv_stride_head = key_cache.strides(2),
      .scale = op.scale,
      .softcap = op.softcap,
      .sliding_window = op.sliding_window,
      .has_sinks = op.has_sinks ? 1 : 0,
      .kv_format = static_cast<int>(op.kv_format),
      .k_scale = op.k_scale,
      .v_scale = op.v_scale,
      .head_dim = query.shape(2),
  };
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array& query = inputs[0];
  mx::array key_cache = cpu::packed_rows(inputs[1], encoder);
  mx::array value_cache = cpu::packed_rows(inputs[2], encoder);
  mx::array block_tables = cpu::row_contiguous(inputs[3], encoder);
  mx::array seq_lens = cpu::row_contiguous(inputs[4], encoder);
  mx::array cu_seqlens_q = cpu::row_contiguous(inputs[5], encoder);
  std::optional<mx::array> sinks;
  if (has_sinks) sinks = cpu::row_contiguous(inputs[6], encoder);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  cpu::AttentionArgs a = cpu::attention_args(
      cpu::strided(query), cpu::strided(key_cache), cpu::strided(value_cache),
      cpu::strided(block_tables), seq_lens.data<int32_t>(), cu_seqlens_q.data<int32_t>(),
      sinks ? sinks->data<float>() : nullptr, out.data<void>(), cpu::elem_type(query.dtype()),
      scale, sliding_window, softcap);
  a.kv_format = kv_format;
  a.k_scale = k_scale;
  a.v_scale = v_scale;

  encoder.set_input_array(query);
  encoder.set_output_array(out);
  if (a.num_tokens == 0) return;
  encoder.dispatch([a, isa = cpu::active_isa()]() { cpu::paged_attention(a, isa); });
}

}  // namespace vllm_metal
