"""A linear projection with LoRA slots, and the batched update every row of a step shares.

Each wrapped projection keeps its adapters stacked by rank block: `lora_a` is
`[slots * rank, in]` (each adapter's A transposed) and `lora_b` is `[slots * rank, out]` with each
adapter's scaling folded in; an adapter of a smaller rank fills the front of its block and leaves
the rest zero. One step's update for all tokens is two dense matmuls over the first `w` rows,
the blocks up to the highest slot the step uses (a row prefix, so no copy):

    y = base(x) + ((x @ lora_a[:w].T) * mask) @ lora_b[:w]

where `mask[t]` is 1 on the rank block of token t's adapter and 0 elsewhere (all 0 for a base
model token). When every token of the step uses one adapter (a single stream, or a batch on one
adapter), the update is that adapter's block alone, without a mask. Rows of different adapters
and of the base model therefore run in one forward, in prefill and in decode alike, without
regrouping the batch; the extra work per token is at most `slots * rank * (in + out)`
multiply-adds, against `in * out` for the projection itself.
(`bench/lora.py` compares this with MLX's `gather_mm`, which selects one adapter per row.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


class StepMask:
    """The token -> adapter mapping of the step being built, shared by every wrapped projection:
    the rank-block rows the step reads (None: no adapter this step) and the token mask over
    them (None: every token uses all of them, i.e. one adapter)."""

    def __init__(self) -> None:
        self.rows: slice | None = None
        self.mask: mx.array | None = None  # [T, 1, rows]

    def clear(self) -> None:
        self.rows = self.mask = None


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
        step = self._step
        if step.rows is None:
            return y
        delta = self.update(x, step.rows, step.mask)
        return y + (delta if delta.dtype == y.dtype else delta.astype(y.dtype))

    def update(self, x: mx.array, rows: slice, mask: mx.array | None) -> mx.array:
        """The adapters' contribution for tokens `x`: rank-block `rows`, under `mask` if given."""
        if x.dtype != self.lora_a.dtype:
            x = x.astype(self.lora_a.dtype)
        h = x @ self.lora_a[rows].T
        if mask is not None:
            h = h * mask
        return h @ self.lora_b[rows]

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
