"""Paged decode attention as one CUDA kernel, for MLX's CUDA device (the GPU proxy,
docs/gpu-proxy.md): it reads the K/V pools in place through the block tables, as the Metal
kernels do on a Mac, where the pure-MLX op (`batched.decode_attention`) gathers every
sequence's blocks first. The proxy is meant to measure the engine around the kernels; with the
gather in their place, batched decode there waits on a copy no Mac makes.

One thread block per (sequence, KV head) attends for the query heads that share the KV head:
each warp walks every WARPS-th key position of the sequence with an online softmax (a lane
holds D / 32 of each row), and the warps' partial results are merged in shared memory. Math is
float32. It serves decode steps without a soft cap, sinks or an fp8 pool; `decode_attention`
returns None for any other call, and the caller runs the pure-MLX op.
"""

from __future__ import annotations

import functools

import mlx.core as mx

WARPS = 8  # warps per thread block: key positions are dealt out among them
SHARED_BYTES = 48 * 1024  # static shared memory a block may take without opting in

SOURCE = """
    constexpr int G = HQ / HKV;  // query heads per KV head
    constexpr int PER = D / 32;  // elements of a row per lane
    const float neg_inf = __int_as_float(0xff800000);
    const int s = blockIdx.x / HKV;
    const int g = blockIdx.x % HKV;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int max_blocks = block_tables_shape[1];
    const int seq_len = seq_lens[s];
    const int first = WINDOW > 0 ? max(0, seq_len - WINDOW) : 0;
    const float sc = scale[0];

    float qv[G][PER], acc[G][PER], m[G], l[G];
    for (int j = 0; j < G; ++j) {
        const size_t row = ((size_t)s * HQ + g * G + j) * D + lane * PER;
        for (int i = 0; i < PER; ++i) {
            qv[j][i] = static_cast<float>(query[row + i]) * sc;
            acc[j][i] = 0.f;
        }
        m[j] = neg_inf;
        l[j] = 0.f;
    }
    for (int k = first + warp; k < seq_len; k += WARPS) {
        const int block = block_tables[(size_t)s * max_blocks + k / BS];
        const size_t at = (((size_t)block * BS + k % BS) * HKV + g) * D + lane * PER;
        float kr[PER], vr[PER];
        for (int i = 0; i < PER; ++i) {
            kr[i] = static_cast<float>(key_cache[at + i]);
            vr[i] = static_cast<float>(value_cache[at + i]);
        }
        for (int j = 0; j < G; ++j) {
            float dot = 0.f;
            for (int i = 0; i < PER; ++i) {
                dot += qv[j][i] * kr[i];
            }
            for (int offset = 16; offset > 0; offset >>= 1) {
                dot += __shfl_xor_sync(0xffffffffu, dot, offset);
            }
            const float top = fmaxf(m[j], dot);
            const float keep = __expf(m[j] - top);
            const float p = __expf(dot - top);
            l[j] = l[j] * keep + p;
            for (int i = 0; i < PER; ++i) {
                acc[j][i] = acc[j][i] * keep + p * vr[i];
            }
            m[j] = top;
        }
    }

    __shared__ float part_m[WARPS][G];
    __shared__ float part_l[WARPS][G];
    __shared__ float part_acc[WARPS][G][D];
    for (int j = 0; j < G; ++j) {
        if (lane == 0) {
            part_m[warp][j] = m[j];
            part_l[warp][j] = l[j];
        }
        for (int i = 0; i < PER; ++i) {
            part_acc[warp][j][lane * PER + i] = acc[j][i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * D; e += WARPS * 32) {
        const int j = e / D;
        const int d = e % D;
        float top = neg_inf;
        for (int w = 0; w < WARPS; ++w) {
            top = fmaxf(top, part_m[w][j]);
        }
        float total = 0.f, value = 0.f;
        for (int w = 0; w < WARPS; ++w) {
            if (part_m[w][j] == neg_inf) {
                continue;  // a warp that saw no key
            }
            const float c = __expf(part_m[w][j] - top);
            total += part_l[w][j] * c;
            value += part_acc[w][j][d] * c;
        }
        out[((size_t)s * HQ + g * G + j) * D + d] = static_cast<T>(total > 0.f ? value / total : 0.f);
    }
"""

INPUTS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "scale")


def available() -> bool:
    """Whether the default device is MLX's CUDA GPU."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="vllm_metal_paged_decode", input_names=list(INPUTS), output_names=["out"],
        source=SOURCE,
    )  # fmt: skip


@functools.cache
def _scale(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def template(
    query: mx.array, key_cache: mx.array, sliding_window: int | None
) -> list[tuple[str, object]] | None:
    """The kernel's compile-time constants for these shapes, or None where it does not apply
    (a head size that is no multiple of 32, or more shared memory than a block gets)."""
    num_heads, head_size = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    if head_size % 32 or WARPS * group * (head_size + 2) * 4 > SHARED_BYTES:
        return None
    return [
        ("T", query.dtype), ("HQ", num_heads), ("HKV", num_kv_heads), ("D", head_size),
        ("BS", block_size), ("WINDOW", sliding_window or 0), ("WARPS", WARPS),
    ]  # fmt: skip


def decode_attention(
    query: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: mx.array,
    seq_lens: mx.array,
    *,
    scale: float,
    sliding_window: int | None = None,
) -> mx.array | None:
    """`paged_attention` of a decode step (row ``s``: sequence ``s``'s query at position
    ``seq_lens[s] - 1``) on validated arguments, or None where the kernel does not apply."""
    constants = template(query, key_cache, sliding_window)
    if constants is None or key_cache.dtype != query.dtype:
        return None
    num_seqs = query.shape[0]
    num_kv_heads = key_cache.shape[2]
    return _kernel()(
        inputs=[query, key_cache, value_cache, block_tables, seq_lens, _scale(float(scale))],
        template=constants,
        grid=(num_seqs * num_kv_heads * WARPS * 32, 1, 1),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[query.shape],
        output_dtypes=[query.dtype],
    )[0]
