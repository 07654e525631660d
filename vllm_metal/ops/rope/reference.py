"""Pure-MLX reference of rotary_embedding (the contract: vllm_metal.ops.rope).

Each token's cos/sin row is gathered by its (clamped) position and broadcast over the heads; the
rotated part is split into its two halves (neox) or its even and odd elements (GPT-J), rotated in
float32 and put back in place; the rest of each head passes through unchanged.
"""

from __future__ import annotations

import mlx.core as mx


def rotate(x: mx.array, cos: mx.array, sin: mx.array, is_neox: bool) -> mx.array:
    """``x`` ``[T, H, D]`` with its first ``2 * cos.shape[-1]`` elements rotated; ``cos`` and
    ``sin`` ``[T, 1, R/2]`` float32."""
    half = cos.shape[-1]
    rot = x[..., : 2 * half].astype(mx.float32)
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        out = mx.concatenate([o1, o2], axis=-1)
    else:
        out = mx.stack([o1, o2], axis=-1).reshape(*o1.shape[:-1], 2 * half)
    return mx.concatenate([out.astype(x.dtype), x[..., 2 * half :]], axis=-1)


def rotary_embedding(
    positions: mx.array,
    query: mx.array,
    key: mx.array,
    cos_sin_cache: mx.array,
    is_neox: bool,
) -> tuple[mx.array, mx.array]:
    max_position, rotary_dim = cos_sin_cache.shape
    half = rotary_dim // 2
    rows = cos_sin_cache[mx.clip(positions, 0, max_position - 1)].astype(mx.float32)
    cos, sin = rows[:, None, :half], rows[:, None, half:]
    return rotate(query, cos, sin, is_neox), rotate(key, cos, sin, is_neox)
