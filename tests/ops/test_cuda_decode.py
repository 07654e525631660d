"""The CUDA paged decode kernel of the GPU proxy (`ops/attention/cuda.py`): its source compiles as
MLX's `cuda_kernel` lays it out (with nvcc, where the machine has it), and on MLX's CUDA GPU it
equals the per-sequence reference for dense, GQA, windowed and ragged batches."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.ops.attention import cuda, reference

# What MLX puts before a `cuda_kernel`'s body (mlx/backend/cuda/custom_kernel.cpp, build_kernel):
# its device header (here only what the body uses from it), then the signature built from the
# input and output names, then each template argument as a constant.
HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cstdint>
#define inf cuda::std::numeric_limits<float>::infinity()
using Shape = cuda::std::array<int32_t, 8>;
"""
SIGNATURE = """
__global__ void {NAME}(
    const {T}* query, const {T}* key_cache, const {T}* value_cache, const int32_t* block_tables,
    const __grid_constant__ Shape block_tables_shape, const int32_t* seq_lens, const float* scale,
    {T}* out) {
    using T = {T};
    constexpr int HQ = {HQ}; constexpr int HKV = {HKV}; constexpr int D = {D};
    constexpr int BS = {BS}; constexpr int WINDOW = {WINDOW}; constexpr int WARPS = {WARPS};
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_the_kernel_source_compiles(tmp_path):
    """One kernel per dtype, GQA group and window, in one translation unit (one nvcc run)."""
    cases = [("__nv_bfloat16", 16, 8, 128, 0), ("__half", 8, 1, 64, 32), ("float", 4, 4, 256, 0)]
    units = []
    for i, (ctype, heads, kv_heads, dim, window) in enumerate(cases):
        constants = {"T": ctype, "HQ": heads, "HKV": kv_heads, "D": dim, "BS": 16,
                     "WINDOW": window, "WARPS": cuda.WARPS, "NAME": f"paged_decode_{i}"}  # fmt: skip
        source = SIGNATURE
        for name, value in constants.items():
            source = source.replace("{" + name + "}", str(value))
        units.append(source + cuda.SOURCE + "\n}\n")
    path = tmp_path / "kernel.cu"
    path.write_text(HEADER + "namespace mlx::core::cu {\n" + "".join(units) + "}\n")
    done = subprocess.run(
        ["nvcc", "-c", "-arch=sm_90", "-std=c++17", str(path), "-o", str(tmp_path / "k.o")],
        check=False, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_shapes_it_declines():
    q = mx.zeros((2, 8, 48), mx.float16)  # head size 48: no multiple of 32
    pool = mx.zeros((4, 16, 2, 48), mx.float16)
    assert cuda.template(q, pool, None) is None
    q = mx.zeros((2, 64, 256), mx.float32)  # 64 query heads on one KV head: too much shared memory
    assert cuda.template(q, mx.zeros((4, 16, 1, 256), mx.float32), None) is None
    constants = dict(cuda.template(mx.zeros((2, 16, 128), mx.bfloat16),
                                   mx.zeros((4, 16, 8, 128), mx.bfloat16), 24))  # fmt: skip
    assert (constants["HQ"], constants["HKV"], constants["D"], constants["WINDOW"]) == (
        16,
        8,
        128,
        24,
    )


@pytest.mark.skipif(not cuda.available(), reason="needs MLX's CUDA GPU")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, window", [(16, 8, 128, None), (8, 2, 64, 20), (4, 4, 256, None)]
)
def test_equals_the_reference_on_the_cuda_gpu(dtype, heads, kv_heads, dim, window):
    rng = np.random.default_rng(0)
    block, lens = 16, np.array([1, 37, 16, 90], dtype=np.int32)
    blocks = -(-lens // block)
    num_blocks = int(blocks.sum()) + 1
    tables = np.zeros((len(lens), int(blocks.max()) + 2), dtype=np.int32)  # padded columns
    order = rng.permutation(np.arange(1, num_blocks))
    at = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[at : at + n]
        at += n
    pools = [
        mx.array(rng.normal(size=(num_blocks, block, kv_heads, dim))).astype(dtype)
        for _ in range(2)
    ]
    q = mx.array(rng.normal(size=(len(lens), heads, dim))).astype(dtype)
    scale = dim**-0.5
    got = cuda.decode_attention(q, *pools, mx.array(tables), mx.array(lens), scale=scale,
                                sliding_window=window)  # fmt: skip
    assert got is not None
    cu = mx.arange(len(lens) + 1, dtype=mx.int32)
    want = reference.paged_attention(q, *pools, mx.array(tables), mx.array(lens), cu,
                                     scale=scale, sliding_window=window)  # fmt: skip
    tol = 2e-2 if dtype == mx.bfloat16 else 1e-4
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               atol=tol, rtol=tol)  # fmt: skip
