"""MLX arrays handed to vLLM's torch-side code on the host."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch


def to_torch(a: mx.array) -> torch.Tensor:
    """A torch view of an evaluated MLX array where possible (waits for it); numpy keeps the
    buffer alive."""
    return torch.from_numpy(np.asarray(a))


def to_host(a: mx.array) -> np.ndarray:
    """The values of an MLX array on the host (waits for it)."""
    return np.asarray(a)
