// mla_attention and mla_reshape_and_cache: the op builders and eval_cpu bodies, which stage the
// inputs and hand plain pointers to the CPU drivers (cpu.h here, ops/cache/cpu.h for the write).

#include "ops/mla/op.h"

#include <memory>
#include <utility>

#include "common/array_utils.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "ops/cache/cpu.h"
#include "ops/cache/op.h"
#include "ops/mla/cpu.h"

namespace vllm_metal {

mx::array mla_attention(const mx::array& query, const mx::array& latent_cache,
                        const mx::array& block_tables, const mx::array& seq_lens,
                        const mx::array& cu_seqlens_q, float scale, int value_dim,
                        mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  return mx::array({query.shape(0), query.shape(1), value_dim}, query.dtype(),
                   std::make_shared<MlaAttention>(stream, scale, value_dim),
                   {query, latent_cache, block_tables, seq_lens, cu_seqlens_q});
}

mx::array mla_reshape_and_cache(const mx::array& latent, const mx::array& latent_cache,
                                const mx::array& slot_mapping, mx::StreamOrDevice s) {
  return mx::array(latent_cache.shape(), latent_cache.dtype(),
                   std::make_shared<MlaReshapeAndCache>(mx::to_stream(s)),
                   {latent, latent_cache, slot_mapping});
}

metal_args::MlaAttentionParams mla_attention_metal_args(const MlaAttention& op,
                                                        const std::vector<mx::array>& inputs) {
  const mx::array& query = inputs[0];
  const mx::array& cache = inputs[1];
  return {
      .num_tokens = query.shape(0),
      .num_seqs = inputs[3].shape(0),
      .num_heads = query.shape(1),
      .num_blocks = cache.shape(0),
      .block_size = cache.shape(1),
      .max_blocks_per_seq = inputs[2].shape(1),
      .q_stride_token = query.strides(0),
      .q_stride_head = query.strides(1),
      .cache_stride_block = cache.strides(0),
      .cache_stride_slot = cache.strides(1),
      .scale = op.scale,
      .pad0 = 0,
  };
}

metal_args::MlaReshapeAndCacheParams mla_reshape_and_cache_metal_args(
    const std::vector<mx::array>& inputs) {
  const mx::array& latent = inputs[0];
  const mx::array& cache = inputs[1];
  return {
      .num_tokens = latent.shape(0),
      .latent_dim = latent.shape(1),
      .num_slots = static_cast<int64_t>(cache.shape(0)) * cache.shape(1),
      .latent_stride_token = latent.strides(0),
      .cache_stride_block = cache.strides(0),
      .cache_stride_slot = cache.strides(1),
      .block_size = cache.shape(1),
      .pad0 = 0,
  };
}

void MlaAttention::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  mx::array query = cpu::row_contiguous(inputs[0], encoder);
  mx::array cache = cpu::packed_rows(inputs[1], encoder);
  mx::array block_tables = cpu::row_contiguous(inputs[2], encoder);
  mx::array seq_lens = cpu::row_contiguous(inputs[3], encoder);
  mx::array cu_seqlens_q = cpu::row_contiguous(inputs[4], encoder);
  out.set_data(mx::allocator::malloc(out.nbytes()));

  const cpu::MlaAttentionArgs a{
      .query = query.data<void>(),
      .latent_cache = cache.data<void>(),
      .block_tables = block_tables.data<int32_t>(),
      .seq_lens = seq_lens.data<int32_t>(),
      .cu_seqlens_q = cu_seqlens_q.data<int32_t>(),
      .out = out.data<void>(),
      .dtype = cpu::elem_type(query.dtype()),
      .num_tokens = query.shape(0),
      .num_seqs = seq_lens.shape(0),
      .num_heads = query.shape(1),
      .latent_dim = query.shape(2),
      .value_dim = value_dim,
      .num_blocks = cache.shape(0),
      .block_size = cache.shape(1),
      .max_blocks = block_tables.shape(1),
      .cache_stride_b = cache.strides(0),
      .scale = scale,
  };
  for (const mx::array& x : {query, cache, block_tables, seq_lens, cu_seqlens_q}) {
    encoder.set_input_array(x);
  }
  encoder.set_output_array(out);
  if (out.size() == 0) return;
  encoder.dispatch([a]() { cpu::mla_attention(a); });
}

void MlaReshapeAndCache::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  auto& encoder = mx::cpu::get_command_encoder(stream());
  const mx::array& latent = inputs[0];
  mx::array slots = cpu::row_contiguous(inputs[2], encoder);
  bind_output_pool(inputs[1], out, encoder);
  if (latent.size() == 0) return;

  const cpu::CacheWriteArgs w = write_args(latent, out, slots.data<int64_t>());
  encoder.dispatch([w]() { cpu::write_cache(w); });
}

}  // namespace vllm_metal
