"""torch dtypes (what vLLM's config speaks) to MLX dtypes."""

from __future__ import annotations

import mlx.core as mx
import torch

TORCH_TO_MLX_DTYPE = {
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.bfloat16: mx.bfloat16,
}


def to_mlx_dtype(dtype: torch.dtype) -> mx.Dtype:
    try:
        return TORCH_TO_MLX_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"dtype={dtype} has no MLX counterpart here") from None
