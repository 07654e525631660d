// The constants the native ops share: their host code (csrc/), their Metal kernels
// (metal_kernels/) and Python (vllm_metal.ops reads _C.CONSTANTS, or parses this file when the
// extension is not built). State a value here once and derive everything else from it.
//
// The file is C++20 and Metal Shading Language at once: integer macros, X-macro lists and
// constexpr functions of ints. Python's parser (vllm_metal/ops/_header.py) reads every
// `#define VM_NAME <integer>` and every list `#define VM_NAME(X, ...) X(a, ..., __VA_ARGS__) ...`
// (entries may name other lists); bindings.cpp exports exactly the same set as _C.CONSTANTS, and
// tests/ops/test_constants.py holds the two equal. Names ending in an underscore are helpers.
//
// A list calls X once per entry with the entry's fields and then the caller's context (the extra
// arguments after X), so lists nest: a callback receives `(fields..., context...)` and must accept
// a trailing empty argument when the list is expanded without context.
#pragma once

// Bumped whenever the ops' inputs, outputs or semantics change, so a stale _C is refused.
#define VM_OPS_ABI 13

// ---- element types -----------------------------------------------------------------------------
// X(tag, msl_type, mlx_name, bytes, ...): the float types of queries and KV pools (math is float32
// in every kernel). The tag names kernels and plans ("f16").
#define VM_DTYPE_F16_(X, ...) X(f16, half, float16, 2, __VA_ARGS__)
#define VM_DTYPE_BF16_(X, ...) X(bf16, bfloat, bfloat16, 2, __VA_ARGS__)
#define VM_DTYPE_F32_(X, ...) X(f32, float, float32, 4, __VA_ARGS__)
// Two-byte types: the neural-accelerator kernels take only these, and only their rows fit
// threadgroup memory at the wide head sizes.
#define VM_HALF_DTYPES(X, ...) VM_DTYPE_F16_(X, __VA_ARGS__) VM_DTYPE_BF16_(X, __VA_ARGS__)
#define VM_FLOAT_DTYPES(X, ...) VM_HALF_DTYPES(X, __VA_ARGS__) VM_DTYPE_F32_(X, __VA_ARGS__)

// ---- fp8 KV caches ------------------------------------------------------------------------------
// X(name, id, mantissa_bits, bias, max_finite, finite_only, ...): the byte formats of
// --kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2 (vllm_metal/ops/fp8.py states their semantics). `id`
// is the kernels' kv_format (VM_KV_FORMAT_SAME: the pools hold the query's dtype); finite_only:
// OCP "FN", no infinities and only S.1111.111 is NaN (else IEEE-like: the top exponent is Inf/NaN).
#define VM_FP8_FORMATS(X, ...) \
  X(fp8_e4m3, 1, 3, 7, 448, 1, __VA_ARGS__) X(fp8_e5m2, 2, 2, 15, 57344, 0, __VA_ARGS__)
#define VM_KV_FORMAT_SAME 0
// The byte a NaN stores (sign clear; NaN in both formats).
#define VM_FP8_NAN_CODE 127

// ---- per-token-head KV caches -------------------------------------------------------------------
// X(name, id, ...): --kv-cache-dtype int8_per_token_head / fp8_per_token_head /
// int4_per_token_head (vllm_metal/ops/per_token_head.py states their semantics,
// common/per_token_head.h the kernels' store and load). `id` is the kernels' kv_format: uint8 pools
// whose (token, KV head) rows are head_dim one-byte elements (int8, or fp8_e4m3 bytes) or head_dim
// / 2 bytes of two int4 levels, followed by the row's float32 scale (VM_PTH_SCALE_BYTES,
// little-endian).
#define VM_PTH_FORMATS(X, ...)                                                   \
  X(int8_per_token_head, 3, __VA_ARGS__) X(fp8_per_token_head, 4, __VA_ARGS__) \
  X(int4_per_token_head, 5, __VA_ARGS__)
#define VM_PTH_SCALE_BYTES 4

// ---- head sizes --------------------------------------------------------------------------------
// X(head_size, ...). Every kernel family is built for the decode head sizes; the wide ones only for
// the prefill families (prefill, nax), which then also run their decode rows.
#define VM_DECODE_HEAD_SIZES(X, ...) \
  X(64, __VA_ARGS__) X(80, __VA_ARGS__) X(96, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)
#define VM_WIDE_HEAD_SIZES(X, ...) X(512, __VA_ARGS__)
#define VM_HEAD_SIZES(X, ...) \
  VM_DECODE_HEAD_SIZES(X, __VA_ARGS__) VM_WIDE_HEAD_SIZES(X, __VA_ARGS__)

// ---- multi-head latent attention ----------------------------------------------------------------
// X(latent_dim, value_dim, ...): the (kv_lora_rank + rope_dim, kv_lora_rank) sizes the MLA kernel
// is built for: DeepSeek-V2/V3 and Kimi K2 (576, 512), MiniCPM3 (288, 256). Other sizes run the
// reference on the GPU (the C++ CPU body takes any).
#define VM_MLA_SIZES(X, ...) X(576, 512, __VA_ARGS__) X(288, 256, __VA_ARGS__)

// ---- vLLM blocks -------------------------------------------------------------------------------
// A kernel reads the KV pools in tiles that never span two vLLM blocks. Kernels are built per block
// divisor B, X(B, ...): for vLLM block sizes that are multiples of B, with KV tiles of at most B
// keys. The host takes the largest divisor of the block size. Ascending.
#define VM_BLOCK_DIVISORS(X, ...) X(8, __VA_ARGS__) X(16, __VA_ARGS__) X(32, __VA_ARGS__)
// vLLM block sizes must be multiples of the smallest divisor.
#define VM_BLOCK_SIZE_MULTIPLE 8

// ---- tiles and threadgroups --------------------------------------------------------------------
#define VM_SIMD_WIDTH 32
// Metal's guaranteed threadgroup memory on Apple GPUs; every kernel's arrays fit in it.
#define VM_THREADGROUP_MEMORY_BYTES 32768
// V/O columns one threadgroup produces; wider heads run as column halves (separate threadgroups).
#define VM_MAX_VALUE_COLUMNS 256
// decode and reduce kernels: threads per threadgroup (one query head each).
#define VM_DECODE_THREADS 128
// gqa kernel: threads per threadgroup and query heads per threadgroup (one 8-row matrix tile).
#define VM_GQA_THREADS 128
#define VM_GQA_ROWS 8
// nax kernel: (token, head) rows and keys per tile, threads per threadgroup.
#define VM_NAX_ROWS 16
#define VM_NAX_KEYS 16
#define VM_NAX_THREADS 128
// prefill kernel tiles X(rows, keys, ...), largest first: the host takes the first whose keys do
// not exceed the block divisor and whose arrays fit threadgroup memory.
#define VM_PREFILL_TILES(X, ...)                                                              \
  X(32, 32, __VA_ARGS__) X(32, 16, __VA_ARGS__) X(16, 32, __VA_ARGS__) X(16, 16, __VA_ARGS__) \
  X(32, 8, __VA_ARGS__) X(16, 8, __VA_ARGS__) X(8, 8, __VA_ARGS__)
// reshape_and_cache: most threads per threadgroup (one threadgroup per token).
#define VM_CACHE_MAX_THREADS 256
// gated_delta_rule: value rows per threadgroup (one simdgroup each), and the largest key head dim
// its kernel holds in registers (a multiple of the SIMD width; the CPU body takes any).
#define VM_GATED_DELTA_ROWS 4
#define VM_GATED_DELTA_MAX_KEY_DIM 256
// causal_conv1d: most threads per threadgroup (one thread per channel of a row).
#define VM_SHORT_CONV_MAX_THREADS 256
// mamba2_scan: state rows (head-dim entries) per threadgroup (one simdgroup each), and the largest
// state size its kernel holds in registers (a multiple of the SIMD width; the CPU body takes any).
#define VM_MAMBA2_ROWS 4
#define VM_MAMBA2_MAX_STATE_DIM 256
// mla_attention: query heads per threadgroup at most (one simdgroup each; they share every staged
// latent tile), and the most latent rows one tile stages.
#define VM_MLA_HEADS 8
#define VM_MLA_MAX_KEYS 32
// rotary_embedding: most threads per threadgroup (one thread per (token, head, element pair)).
#define VM_ROPE_MAX_THREADS 256

// ---- split-KV decode ---------------------------------------------------------------------------
// Keys per partition (a multiple of every block divisor and of the alignment).
#define VM_PARTITION_SIZE 512
// A row's partitions start at its first attended key rounded down to this.
#define VM_PARTITION_ALIGN 32
// Split when the one-pass grid has fewer threadgroups than this many per GPU core.
#define VM_SPLIT_THREADGROUPS_PER_CORE 8
// GPU cores assumed until the device's own count is known (vllm_metal/ops/_gpu.py).
#define VM_DEFAULT_GPU_CORES 16
// In a mixed batch, decode rows attending at least this many keys get their own dispatch.
#define VM_DECODE_SPLIT_OUT_KEYS 4096

// ---- tile rules (shared by the kernels' templates and the host's planner) -----------------------

// Value columns of one threadgroup for a head size.
constexpr int vm_value_columns(int head_size) {
  return head_size > VM_MAX_VALUE_COLUMNS ? VM_MAX_VALUE_COLUMNS : head_size;
}

// Threads of a prefill threadgroup with `rows` rows: one simdgroup per 8 rows.
constexpr int vm_prefill_threads(int rows) { return rows / 8 * VM_SIMD_WIDTH; }

// Threadgroup bytes of the gqa kernel: Q rows, one K/V tile, S (float), P, diag (float 8x8). Rows
// are padded by 16 bytes; the kernel asserts that its arrays take exactly this.
constexpr int vm_gqa_threadgroup_bytes(int elem_bytes, int head_size, int keys) {
  const int pad = 16 / elem_bytes;
  const int q_pitch = head_size + pad;
  return (VM_GQA_ROWS * q_pitch + keys * q_pitch + VM_GQA_ROWS * (keys + pad)) * elem_bytes +
         (VM_GQA_ROWS * (keys + 4) + 64) * 4;
}

// Threadgroup bytes of the prefill kernel: Q, K, V tiles, S (float), P, diag per simdgroup.
constexpr int vm_prefill_threadgroup_bytes(int elem_bytes, int head_size, int rows, int keys) {
  const int pad = 16 / elem_bytes;
  const int q_pitch = head_size + pad;
  const int v_pitch = vm_value_columns(head_size) + pad;
  return (rows * q_pitch + keys * q_pitch + keys * v_pitch + rows * (keys + pad)) * elem_bytes +
         (rows * (keys + 4) + rows / 8 * 64) * 4;
}

// KV tile of the gqa kernel built for block divisor B: the largest divisor <= B that fits; 0: none.
constexpr int vm_gqa_keys(int elem_bytes, int head_size, int divisor) {
  int keys = 0;
#define VM_GQA_TRY_(K, ...)                                         \
  if (K <= divisor && vm_gqa_threadgroup_bytes(elem_bytes, head_size, K) <= \
                          VM_THREADGROUP_MEMORY_BYTES)                      \
    keys = K;
  VM_BLOCK_DIVISORS(VM_GQA_TRY_, )
#undef VM_GQA_TRY_
  return keys;
}

// Tile of the prefill kernel built for block divisor B, as rows * 64 + keys (0: none fits).
constexpr int vm_prefill_tile_(int elem_bytes, int head_size, int divisor) {
#define VM_PREFILL_TRY_(R, K, ...)                                         \
  if (K <= divisor && vm_prefill_threadgroup_bytes(elem_bytes, head_size, R, K) <= \
                          VM_THREADGROUP_MEMORY_BYTES)                             \
    return R * 64 + K;
  VM_PREFILL_TILES(VM_PREFILL_TRY_, )
#undef VM_PREFILL_TRY_
  return 0;
}
constexpr int vm_prefill_rows(int elem_bytes, int head_size, int divisor) {
  return vm_prefill_tile_(elem_bytes, head_size, divisor) / 64;
}
constexpr int vm_prefill_keys(int elem_bytes, int head_size, int divisor) {
  return vm_prefill_tile_(elem_bytes, head_size, divisor) % 64;
}

// Threadgroup bytes of the mla_attention kernel: a tile of `keys` latent rows and their pool
// offsets (one 8-byte integer each).
constexpr int vm_mla_threadgroup_bytes(int elem_bytes, int latent_dim, int keys) {
  return keys * latent_dim * elem_bytes + keys * 8;
}

// Latent rows per mla_attention tile: the largest power of two up to VM_MLA_MAX_KEYS that fits
// threadgroup memory (at least 1).
constexpr int vm_mla_keys(int elem_bytes, int latent_dim) {
  int keys = VM_MLA_MAX_KEYS;
  while (keys > 1 && vm_mla_threadgroup_bytes(elem_bytes, latent_dim, keys) >
                         VM_THREADGROUP_MEMORY_BYTES) {
    keys /= 2;
  }
  return keys;
}

// Largest block divisor of a vLLM block size (0 when it is not a multiple of any).
constexpr int vm_block_divisor(int block_size) {
  int divisor = 0;
#define VM_DIVISOR_TRY_(B, ...) \
  if (block_size > 0 && block_size % B == 0) divisor = B;
  VM_BLOCK_DIVISORS(VM_DIVISOR_TRY_, )
#undef VM_DIVISOR_TRY_
  return divisor;
}

// ---- kernel instances --------------------------------------------------------------------------
// Each *_INSTANCES list calls X once per [[host_name]] instantiation, with X(tag, msl_type, bytes,
// head_size, block_divisor) or a prefix of it. The .metal sources instantiate exactly these under
// the names below; the host's planners choose among them and _C.all_kernel_names() lists them.
#define VM_KERNEL_NAME_CACHE(DT) "reshape_and_cache_" #DT
#define VM_KERNEL_NAME_DECODE(DT, D, B) "paged_attention_decode_" #DT "_d" #D "_b" #B
#define VM_KERNEL_NAME_REDUCE(DT, D) "paged_attention_reduce_" #DT "_d" #D
#define VM_KERNEL_NAME_GQA(DT, D, B) "paged_attention_gqa_" #DT "_d" #D "_b" #B
#define VM_KERNEL_NAME_PREFILL(DT, D, B) "paged_attention_prefill_" #DT "_d" #D "_b" #B
#define VM_KERNEL_NAME_NAX(DT, D) "paged_attention_nax_" #DT "_d" #D
// The same families over fp8 pools (uint8 bytes; the format is the kv_format argument).
#define VM_KERNEL_NAME_CACHE_FP8(DT) "reshape_and_cache_" #DT "_fp8"
#define VM_KERNEL_NAME_DECODE_FP8(DT, D, B) "paged_attention_decode_" #DT "_fp8_d" #D "_b" #B
#define VM_KERNEL_NAME_GQA_FP8(DT, D, B) "paged_attention_gqa_" #DT "_fp8_d" #D "_b" #B
#define VM_KERNEL_NAME_PREFILL_FP8(DT, D, B) "paged_attention_prefill_" #DT "_fp8_d" #D "_b" #B
#define VM_KERNEL_NAME_NAX_FP8(DT, D) "paged_attention_nax_" #DT "_fp8_d" #D
#define VM_KERNEL_NAME_GATED_DELTA(DT) "gated_delta_rule_" #DT
#define VM_KERNEL_NAME_SHORT_CONV(DT) "causal_conv1d_" #DT
#define VM_KERNEL_NAME_MAMBA2(DT) "mamba2_scan_" #DT
#define VM_KERNEL_NAME_MLA(DT, D, DV) "mla_attention_" #DT "_d" #D "_v" #DV
#define VM_KERNEL_NAME_MLA_CACHE(DT) "mla_reshape_and_cache_" #DT
#define VM_KERNEL_NAME_ROPE(DT, CDT, PT) "rotary_embedding_" #DT "_c" #CDT "_" #PT

#define VM_WITH_DTYPE_(DT, T, NAME, BYTES, X) X(DT, T, BYTES)
#define VM_WITH_HEAD_(D, X, DT, T, BYTES) X(DT, T, BYTES, D)
#define VM_WITH_DIVISOR_(B, X, DT, T, BYTES, D) X(DT, T, BYTES, D, B)
#define VM_HEAD_DIVISORS_(D, X, DT, T, BYTES) \
  VM_BLOCK_DIVISORS(VM_WITH_DIVISOR_, X, DT, T, BYTES, D)
#define VM_DECODE_HEADS_(DT, T, NAME, BYTES, X) \
  VM_DECODE_HEAD_SIZES(VM_HEAD_DIVISORS_, X, DT, T, BYTES)
#define VM_WIDE_HEADS_(DT, T, NAME, BYTES, X) \
  VM_WIDE_HEAD_SIZES(VM_HEAD_DIVISORS_, X, DT, T, BYTES)
#define VM_REDUCE_HEADS_(DT, T, NAME, BYTES, X) \
  VM_DECODE_HEAD_SIZES(VM_WITH_HEAD_, X, DT, T, BYTES)
#define VM_ALL_HEADS_(DT, T, NAME, BYTES, X) VM_HEAD_SIZES(VM_WITH_HEAD_, X, DT, T, BYTES)
#define VM_WITH_MLA_SIZE_(D, DV, X, DT, T, BYTES) X(DT, T, BYTES, D, DV)
#define VM_MLA_SIZES_(DT, T, NAME, BYTES, X) VM_MLA_SIZES(VM_WITH_MLA_SIZE_, X, DT, T, BYTES)

// X(tag, msl_type, bytes): reshape_and_cache, with pools of the rows' dtype and with fp8 pools
// (the _FP8 names; rows of every float type).
#define VM_CACHE_INSTANCES(X) VM_FLOAT_DTYPES(VM_WITH_DTYPE_, X)
// X(tag, msl_type, bytes): gated_delta_rule, causal_conv1d and mamba2_scan.
#define VM_GATED_DELTA_INSTANCES(X) VM_FLOAT_DTYPES(VM_WITH_DTYPE_, X)
#define VM_SHORT_CONV_INSTANCES(X) VM_FLOAT_DTYPES(VM_WITH_DTYPE_, X)
#define VM_MAMBA2_INSTANCES(X) VM_FLOAT_DTYPES(VM_WITH_DTYPE_, X)
// X(tag, msl_type, bytes): mla_reshape_and_cache.
#define VM_MLA_CACHE_INSTANCES(X) VM_FLOAT_DTYPES(VM_WITH_DTYPE_, X)
// X(tag, msl_type, bytes, cache_tag, cache_msl_type, positions_tag, positions_msl_type):
// rotary_embedding. Query/key of each float type, with a cos/sin cache of that type or float32,
// positions int32 or int64.
#define VM_ROPE_POSITIONS_(X, DT, T, BYTES, CDT, CT) \
  X(DT, T, BYTES, CDT, CT, i32, int) X(DT, T, BYTES, CDT, CT, i64, long)
#define VM_ROPE_HALF_(DT, T, NAME, BYTES, X) \
  VM_ROPE_POSITIONS_(X, DT, T, BYTES, DT, T) VM_ROPE_POSITIONS_(X, DT, T, BYTES, f32, float)
#define VM_ROPE_F32_(DT, T, NAME, BYTES, X) VM_ROPE_POSITIONS_(X, DT, T, BYTES, DT, T)
#define VM_ROPE_INSTANCES(X) VM_HALF_DTYPES(VM_ROPE_HALF_, X) VM_DTYPE_F32_(VM_ROPE_F32_, X)
// X(tag, msl_type, bytes, latent_dim, value_dim): mla_attention.
#define VM_MLA_INSTANCES(X) VM_FLOAT_DTYPES(VM_MLA_SIZES_, X)
// X(tag, msl_type, bytes, head_size, block_divisor): decode and gqa (the same set each).
#define VM_DECODE_INSTANCES(X) VM_FLOAT_DTYPES(VM_DECODE_HEADS_, X)
// X(tag, msl_type, bytes, head_size): the split-KV reduce kernel of decode and gqa.
#define VM_REDUCE_INSTANCES(X) VM_FLOAT_DTYPES(VM_REDUCE_HEADS_, X)
// X(tag, msl_type, bytes, head_size, block_divisor): prefill.
#define VM_PREFILL_INSTANCES(X) VM_DECODE_INSTANCES(X) VM_HALF_DTYPES(VM_WIDE_HEADS_, X)
// X(tag, msl_type, bytes, head_size): nax (Metal 4 tensor ops).
#define VM_NAX_INSTANCES(X) VM_HALF_DTYPES(VM_ALL_HEADS_, X)
// Every list above is instantiated twice where fp8 pools are read or written: once with pools of
// the query's (rows') dtype under the names above, once with fp8 pools under the _FP8 names
// (reshape_and_cache, decode, gqa, prefill, nax; the reduce kernel reads no pool).

// ---- TurboQuant KV caches -----------------------------------------------------------------------
// The Metal kernels of --kv-cache-dtype turboquant_* (metal_kernels/turboquant/; the bytes:
// common/turboquant.h). X(head_size, ...): the head sizes of the decode kernels (a simdgroup lane
// holds head_size / 32 elements); a threadgroup scores at most VM_TQ_GROUP_HEADS query heads of
// one KV head, and a split-KV partition holds at least VM_TQ_MIN_PARTITION keys.
#define VM_TQ_HEAD_SIZES(X, ...) X(64, __VA_ARGS__) X(128, __VA_ARGS__) X(256, __VA_ARGS__)
#define VM_TQ_GROUP_HEADS 8
#define VM_TQ_MIN_PARTITION 128
#define VM_KERNEL_NAME_TQ_WRITE "turboquant_write"
#define VM_KERNEL_NAME_TQ_DECODE(D) "turboquant_decode_d" #D
#define VM_KERNEL_NAME_TQ_REDUCE(D) "turboquant_reduce_d" #D
