// reshape_and_cache as an MLX primitive: the op builder, and the primitive whose eval_cpu runs the
// framework-neutral CPU driver (cpu.h) and whose eval_gpu encodes one Metal kernel.
//
// What the op computes is stated once, at the public entry point (vllm_metal/ops/cache/);
// arguments are validated there too, so the builder assumes consistent shapes and dtypes.
//
// Inputs, in order: 0 key [T, Hkv, D]  1 value [T, Hkv, D]  2 key_cache [NB, BS, Hkv, D]
//   3 value_cache (same)  4 slot_mapping [T] int64.
// Pools hold the rows' dtype, or (kv_format fp8_e4m3 / fp8_e5m2) uint8 bytes: a row element x is
// stored as fp8(x / k_scale) (values: v_scale), common/fp8.h.
// Outputs: 0 key_cache', 1 value_cache', shaped and typed as inputs 2 and 3. They alias the input
// pools (out.copy_shared_buffer(in), no copy) whenever the pool layout maps each element to its
// own memory (pool_is_aliasable); only a broadcast or overlapping pool is copied first.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"
#include "ops/cache/cpu.h"
#include "ops/cache/params.h"

namespace vllm_metal {

namespace mx = mlx::core;

class ReshapeAndCache : public mx::Primitive {
 public:
  explicit ReshapeAndCache(mx::Stream stream, cpu::KvFormat kv_format = cpu::KvFormat::same,
                           float k_scale = 1.0f, float v_scale = 1.0f)
      : mx::Primitive(stream), kv_format(kv_format), k_scale(k_scale), v_scale(v_scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "ReshapeAndCache"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const ReshapeAndCache&>(other);
    return kv_format == o.kv_format && k_scale == o.k_scale && v_scale == o.v_scale;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[2].shape(), inputs[3].shape()};
  }

  const cpu::KvFormat kv_format;  // same: pools in the rows' dtype; else fp8 bytes (uint8)
  const float k_scale, v_scale;   // fp8 pools: what one stored unit of K / V is worth
};

// True when writing through `pool`'s strides touches each element's own memory (row-major order
// with possible gaps, as for a contiguous pool or a slice of a larger one), so writes may alias it.
bool pool_is_aliasable(const mx::array& pool);

// The CPU driver's view of one write: rows `src` ([T, H, D], or [T, D] for a headless latent
// cache) into the bound output pool `dst` at `slots`.
cpu::CacheWriteArgs write_args(const mx::array& src, mx::array& dst, const int64_t* slots);

// eval_cpu's binding of an output pool: the input pool's own buffer when it is aliasable, else a
// fresh row-contiguous copy of it (enqueued on `encoder`).
void bind_output_pool(const mx::array& pool, mx::array& out, mx::cpu::CommandEncoder& encoder);

std::pair<mx::array, mx::array> reshape_and_cache(
    const mx::array& key, const mx::array& value, const mx::array& key_cache,
    const mx::array& value_cache, const mx::array& slot_mapping,
    const std::string& kv_cache_dtype = "auto", float k_scale = 1.0f, float v_scale = 1.0f,
    mx::StreamOrDevice s = {});

// The Metal kernel's arguments for a call with these inputs. Host code, built on every platform
// so it is compiled off-Mac too.
metal_args::ReshapeAndCacheParams reshape_and_cache_metal_args(
    const ReshapeAndCache& op, const std::vector<mx::array>& inputs);

}  // namespace vllm_metal
