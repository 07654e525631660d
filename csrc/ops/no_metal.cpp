// eval_gpu for builds without Metal: the primitives exist, but only their CPU bodies can run.

#include <stdexcept>
#include <string>

#include "ops/attention/op.h"
#include "ops/cache/op.h"
#include "ops/gated_delta/op.h"
#include "ops/mamba2/op.h"
#include "ops/mla/op.h"
#include "ops/rope/op.h"
#include "ops/short_conv/op.h"

namespace vllm_metal {

namespace {

[[noreturn]] void no_metal(const char* op) {
  throw std::runtime_error(std::string("vllm_metal._C: ") + op +
                           " was asked to run on the GPU, but this build has no Metal kernels "
                           "(it was built without Metal). Run it on the CPU stream (mx.cpu).");
}

}  // namespace

void ReshapeAndCache::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_metal("reshape_and_cache");
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal("paged_attention");
}

void GatedDeltaRule::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_metal("gated_delta_rule");
}

void CausalConv1d::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_metal("causal_conv1d");
}

void Mamba2Scan::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_metal("mamba2_scan");
}

void MlaAttention::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal("mla_attention");
}

void MlaReshapeAndCache::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  no_metal("mla_reshape_and_cache");
}

void RotaryEmbedding::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  no_metal("rotary_embedding");
}

}  // namespace vllm_metal
