// TurboQuantWrite::eval_gpu and TurboQuantAttention::eval_gpu: encode the kernels the planner
// (plan.h) chooses.
#include <string>

#include "common/device.h"
#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/cache/op.h"  // pool_is_aliasable
#include "ops/turboquant/op.h"
#include "ops/turboquant/plan.h"

namespace vllm_metal {

namespace {

using metal::require;

const int32_t* host_ints(const mx::array& a, const char* name) {
  require(a.status() == mx::array::Status::available && a.flags().row_contiguous,
          "turboquant_attention",
          std::string(name) + " must be a materialized contiguous int32 array so the kernel "
                              "plan can read it");
  return a.data<int32_t>();
}

}  // namespace

void TurboQuantWrite::eval_gpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  const mx::array& key_cache = inputs[3];
  const mx::array& value_cache = inputs[4];
  require(pool_is_aliasable(key_cache) && pool_is_aliasable(value_cache), "turboquant_write",
          "the pools must be writable in place (not broadcast or overlapping views)");
  require(key_cache.strides(3) == 1 && value_cache.strides(3) == 1, "turboquant_write",
          "a pool row's bytes must be contiguous");
  for (int i : {0, 1, 2, 5, 6}) {
    require(inputs[i].flags().row_contiguous, "turboquant_write", "rows must be contiguous");
  }
  outputs[0].copy_shared_buffer(key_cache);
  outputs[1].copy_shared_buffer(value_cache);
  if (inputs[0].size() == 0) return;
  const metal_args::TurboQuantWriteParams p = turboquant_write_metal_args(*this, inputs);
  const TqWriteLaunch l = select_turboquant_write_kernel(inputs[0].shape(0), p.num_kv_heads);
  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(metal::kernel(d, l.kernel));
  enc.set_input_array(inputs[0], TQW_BUF_KEY);
  enc.set_input_array(inputs[1], TQW_BUF_KEY_NORM);
  enc.set_input_array(inputs[2], TQW_BUF_VALUE);
  enc.set_output_array(outputs[0], TQW_BUF_KEY_CACHE);
  enc.set_output_array(outputs[1], TQW_BUF_VALUE_CACHE);
  enc.set_input_array(inputs[5], TQW_BUF_SLOT_MAPPING);
  enc.set_input_array(inputs[6], TQW_BUF_CENTROIDS);
  enc.set_bytes(p, TQW_BUF_PARAMS);
  enc.dispatch_threadgroups(MTL::Size(l.grid, 1, 1), MTL::Size(l.threads, 1, 1));
}

void TurboQuantAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& query = inputs[0];
  const mx::array& key_cache = inputs[1];
  const mx::array& value_cache = inputs[2];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;
  require(query.flags().row_contiguous && inputs[3].flags().row_contiguous &&
              inputs[6].flags().row_contiguous && (!has_sinks || inputs[7].flags().row_contiguous),
          "turboquant_attention", "query, block_tables, centroids and sinks must be contiguous");
  require(key_cache.strides(3) == 1 && value_cache.strides(3) == 1, "turboquant_attention",
          "a pool row's bytes must be contiguous");
  const int num_seqs = inputs[4].shape(0);
  const TqAttentionLaunch l = select_turboquant_attention_kernel(
      query.shape(2), query.shape(1), key_cache.shape(2), query.shape(0),
      host_ints(inputs[5], "cu_seqlens_q"), host_ints(inputs[4], "seq_lens"), num_seqs,
      sliding_window, device::gpu_cores());
  metal_args::TurboQuantAttentionParams p = turboquant_attention_metal_args(*this, inputs);
  p.head_chunks = l.head_chunks;
  p.partition_size = l.partition_size;
  p.num_partitions = l.num_partitions;

  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());
  mx::array work = metal::host_int_array(l.work, enc);
  const mx::array& sinks = has_sinks ? inputs[7] : inputs[4];  // any buffer when unused
  const int64_t rows = static_cast<int64_t>(query.shape(0)) * query.shape(1) * l.num_partitions;
  mx::array partial_ml(mx::allocator::malloc(rows * 2 * sizeof(float)),
                       mx::Shape{static_cast<int>(rows * 2)}, mx::float32);
  mx::array partial_out(mx::allocator::malloc(rows * query.shape(2) * sizeof(float)),
                        mx::Shape{static_cast<int>(rows * query.shape(2))}, mx::float32);
  enc.add_temporary(partial_ml);
  enc.add_temporary(partial_out);

  auto bind = [&]() {
    enc.set_input_array(query, TQA_BUF_QUERY);
    enc.set_input_array(key_cache, TQA_BUF_KEY_CACHE);
    enc.set_input_array(value_cache, TQA_BUF_VALUE_CACHE);
    enc.set_input_array(inputs[3], TQA_BUF_BLOCK_TABLES);
    enc.set_input_array(inputs[4], TQA_BUF_SEQ_LENS);
    enc.set_input_array(inputs[5], TQA_BUF_CU_SEQLENS_Q);
    enc.set_input_array(sinks, TQA_BUF_SINKS);
    enc.set_input_array(inputs[6], TQA_BUF_CENTROIDS);
    enc.set_input_array(work, TQA_BUF_WORK);
    enc.set_bytes(p, TQA_BUF_PARAMS);
  };
  enc.set_compute_pipeline_state(metal::kernel(d, l.kernel));
  bind();
  enc.set_output_array(out, TQA_BUF_OUT);
  enc.set_output_array(partial_ml, TQA_BUF_PARTIAL_ML);
  enc.set_output_array(partial_out, TQA_BUF_PARTIAL_OUT);
  enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                            MTL::Size(l.threads, 1, 1));
  if (l.partition_size == 0) return;
  enc.set_compute_pipeline_state(metal::kernel(d, l.reduce_kernel));
  bind();
  enc.set_input_array(partial_ml, TQA_BUF_PARTIAL_ML);
  enc.set_input_array(partial_out, TQA_BUF_PARTIAL_OUT);
  enc.set_output_array(out, TQA_BUF_OUT);
  enc.dispatch_threadgroups(MTL::Size(l.reduce_grid[0], l.reduce_grid[1], l.reduce_grid[2]),
                            MTL::Size(l.reduce_threads, 1, 1));
}

}  // namespace vllm_metal
