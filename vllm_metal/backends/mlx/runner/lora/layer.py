"""A linear projection with LoRA slots, and the batched update every row of a step shares.

Each wrapped projection keeps its adapters stacked by rank block: `lora_a` is
`[slots * rank, in]` (each adapter's A transposed) and `lora_b` is `[slots * rank, out]` with each
adapter's scaling folded in; an adapter of a smaller rank fills the front of its block and leaves
the rest zero. One step's update for all tokens is two dense matmuls over the first `w` rows,
the blocks up to the highest slot the step uses (a row prefix, so no copy):

    y = base(x) + ((x @ lora_a[:w].T) * mask) @ lora_b[:w]

where `mask[t]` is 1 on the rank block of token t's adapter and 0 elsewhere (all 0 for a base
model token). Rows of different adapters and of the base model therefore run in one forward, in
prefill and in decode alike, without regrouping the batch; the extra work per token is
`slots * rank * (in + out)` multiply-adds, against `in * out` for the projection itself.
(`bench/lora.py` compares this with MLX's `gather_mm`, which selects one adapter per row.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


class StepMask:
    """The token -> adapter mask of the step being built, shared by every wrapped projection."""

    def __init__(self) -> None:
        self.mask: mx.array | None = None  # [T, 1, w]; None: no adapter this step


class LoRALinear(nn.Module):
    def __init__(
        self, base: nn.Module, shape: tuple[int, int], width: int, dtype: mx.Dtype, step: StepMask
    ):
        super().__init__()
        self.base = base
        in_features, out_features = shape
        self.lora_a = mx.zeros((width, in_features), dtype=dtype)
        self.lora_b = mx.zeros((width, out_features), dtype=dtype)
        self._step = step

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        mask = self._step.mask
        if mask is None:
            return y
        return y + self.update(x, mask).astype(y.dtype)

    def update(self, x: mx.array, mask: mx.array) -> mx.array:
        """The adapters' contribution for tokens `x` under `mask` (`[T, 1, w]`)."""
        w = mask.shape[-1]
        return ((x.astype(self.lora_a.dtype) @ self.lora_a[:w].T) * mask) @ self.lora_b[:w]

    def write(self, block_rows: slice, a: mx.array, b: mx.array) -> None:
        """Put one adapter's `a [in, r]` and `b [r, out]` into the rank block `block_rows`."""
        block = block_rows.stop - block_rows.start
        rank = a.shape[1]
        if rank < block:
            a = mx.pad(a, [(0, 0), (0, block - rank)])
            b = mx.pad(b, [(0, block - rank), (0, 0)])
        self.lora_a[block_rows, :] = a.T.astype(self.lora_a.dtype)
        self.lora_b[block_rows, :] = b.astype(self.lora_b.dtype)

    def clear(self, block_rows: slice) -> None:
        self.lora_a[block_rows, :] = 0
        self.lora_b[block_rows, :] = 0


def projection_shape(module: Any) -> tuple[int, int] | None:
    """(in_features, out_features) of a dense or MLX-quantized linear, None for other modules."""
    if isinstance(module, nn.QuantizedLinear):
        out_features, packed = module.weight.shape
        return packed * 32 // module.bits, out_features
    if isinstance(module, nn.Linear):
        out_features, in_features = module.weight.shape
        return in_features, out_features
    return None
