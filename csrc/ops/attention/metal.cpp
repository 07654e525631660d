// PagedAttention::eval_gpu: encodes the kernels that the planner (plan.h) chooses for this batch.
#include <stdexcept>
#include <string>

#include "common/metal_library.h"
#include "mlx/allocator.h"
#include "ops/attention/op.h"
#include "ops/attention/plan.h"

namespace vllm_metal {

namespace {

using metal::require;

// The plan is made on the host from the per-sequence lengths, so they must be readable now.
const int32_t* host_ints(const mx::array& a, const char* name) {
  require(a.status() == mx::array::Status::available && a.flags().row_contiguous,
          "paged_attention",
          std::string(name) + " must be a materialized contiguous int32 array (e.g. built "
                              "with mx.array from host data) so the kernel plan can read it");
  return a.data<int32_t>();
}

// The KV kernels read 4-element vectors: byte offset and row strides must keep that alignment.
bool vec4_aligned(const mx::array& a) {
  const int64_t vec_bytes = 4 * static_cast<int64_t>(a.itemsize());
  return a.offset() % vec_bytes == 0 && a.strides(0) % 4 == 0 && a.strides(1) % 4 == 0 &&
         a.strides(2) % 4 == 0;
}

}  // namespace

void PagedAttention::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const mx::array& query = inputs[0];
  const mx::array& key_cache = inputs[1];
  const mx::array& value_cache = inputs[2];
  const mx::array& block_tables = inputs[3];
  const mx::array& seq_lens = inputs[4];
  const mx::array& cu_seqlens_q = inputs[5];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (out.size() == 0) return;

  require(query.strides(2) == 1, "paged_attention", "query needs a contiguous head_dim axis");
  require(key_cache.strides() == value_cache.strides() && key_cache.strides(3) == 1 &&
              vec4_aligned(key_cache) && vec4_aligned(value_cache),
          "paged_attention",
          "key_cache and value_cache need equal strides, a contiguous head_dim axis and "
          "4-element alignment");
  require(block_tables.flags().row_contiguous, "paged_attention",
          "block_tables must be contiguous");
  if (has_sinks) {
    require(inputs[6].flags().row_contiguous, "paged_attention", "sinks must be contiguous");
  }
  const int num_seqs = seq_lens.shape(0);
  const int32_t* cu_host = host_ints(cu_seqlens_q, "cu_seqlens_q");
  const int32_t* lens_host = host_ints(seq_lens, "seq_lens");

  auto& d = mx::metal::device(stream().device);
  auto& enc = mx::metal::get_command_encoder(stream());

  AttentionShape shape;
  shape.dtype = metal::dtype_tag(query.dtype());
  shape.fp8_pools = kv_format != cpu::KvFormat::same;
  shape.num_q_heads = query.shape(1);
  shape.num_kv_heads = key_cache.shape(2);
  shape.head_dim = query.shape(2);
  shape.block_size = key_cache.shape(1);
  shape.sliding_window = sliding_window;
  const DeviceCaps caps = device_caps(metal::supports_nax(d));
  const AttentionPlan plan =
      select_paged_attention_kernel(shape, cu_host, lens_host, num_seqs, caps);

  metal_args::PagedAttentionParams p = paged_attention_metal_args(*this, inputs);
  const mx::array& sinks = has_sinks ? inputs[6] : seq_lens;  // any buffer when unused

  for (const AttentionLaunch& l : plan.launches) {
    mx::array work = metal::host_int_array(l.work, enc);
    p.num_work = l.family == "prefill" || l.family == "nax"
                     ? static_cast<int>(l.work.size() / 2)
                     : static_cast<int>(l.work.size());
    p.partition_size = l.partition_size;
    p.scratch_heads = l.scratch_heads;

    // The slots the main kernels and the reduce kernel both read.
    auto bind_rows = [&]() {
      enc.set_input_array(cu_seqlens_q, PA_BUF_CU_SEQLENS_Q);
      enc.set_input_array(sinks, PA_BUF_SINKS);
      enc.set_output_array(out, PA_BUF_OUT);
      enc.set_input_array(work, PA_BUF_WORK);
      enc.set_bytes(p, PA_BUF_PARAMS);
    };
    enc.set_compute_pipeline_state(metal::kernel(d, l.kernel));
    enc.set_input_array(query, PA_BUF_QUERY);
    enc.set_input_array(key_cache, PA_BUF_KEY_CACHE);
    enc.set_input_array(value_cache, PA_BUF_VALUE_CACHE);
    enc.set_input_array(block_tables, PA_BUF_BLOCK_TABLES);
    enc.set_input_array(seq_lens, PA_BUF_SEQ_LENS);
    bind_rows();
    if (l.family == "prefill" || l.family == "nax") {
      enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                                MTL::Size(l.threads, 1, 1));
      continue;
    }

    if (l.partition_size == 0) {
      // One pass: the split-KV buffers are declared by the kernel but never touched.
      enc.set_input_array(work, PA_BUF_PART_OFFSETS);
      enc.set_input_array(work, PA_BUF_PARTIAL_ML);
      enc.set_input_array(work, PA_BUF_PARTIAL_OUT);
      enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                                MTL::Size(l.threads, 1, 1));
      continue;
    }
    // Split-KV: scratch sized by the sum of each row's own partition count.
    const int64_t scratch_rows = static_cast<int64_t>(l.total_partitions) * l.scratch_heads;
    mx::array part_offsets = metal::host_int_array(l.part_offsets, enc);
    mx::array partial_ml(mx::allocator::malloc(scratch_rows * 2 * sizeof(float)),
                         mx::Shape{static_cast<int>(scratch_rows * 2)}, mx::float32);
    mx::array partial_out(
        mx::allocator::malloc(scratch_rows * shape.head_dim * sizeof(float)),
        mx::Shape{static_cast<int>(scratch_rows * shape.head_dim)}, mx::float32);
    enc.add_temporary(partial_ml);
    enc.add_temporary(partial_out);
    enc.set_input_array(part_offsets, PA_BUF_PART_OFFSETS);
    enc.set_output_array(partial_ml, PA_BUF_PARTIAL_ML);
    enc.set_output_array(partial_out, PA_BUF_PARTIAL_OUT);
    enc.dispatch_threadgroups(MTL::Size(l.grid[0], l.grid[1], l.grid[2]),
                              MTL::Size(l.threads, 1, 1));

    enc.set_compute_pipeline_state(metal::kernel(d, l.reduce_kernel));
    bind_rows();
    enc.set_input_array(part_offsets, PA_BUF_PART_OFFSETS);
    enc.set_input_array(partial_ml, PA_BUF_PARTIAL_ML);
    enc.set_input_array(partial_out, PA_BUF_PARTIAL_OUT);
    enc.dispatch_threadgroups(
        MTL::Size(l.reduce_grid[0], l.reduce_grid[1], l.reduce_grid[2]),
        MTL::Size(l.reduce_threads, 1, 1));
  }
}

}  // namespace vllm_metal
