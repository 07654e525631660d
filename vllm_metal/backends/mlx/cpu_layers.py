"""Layers of a loaded decoder swapped for faster ones where MLX computes on its CPU device.

MLX has no CPU kernel for `mx.fast.rope` or `mx.fast.rms_norm`: there each call builds and runs a
graph of small ops (the angles' exponentials, cosines and sines recomputed every call for RoPE).
On a decoder as narrow as the CPU benchmark's (Qwen3-0.6B's 28 layers at a width of 64), those
graphs were most of an eager decode step: a RoPE call took 150 us at one row and 335 us at 32, an
RMSNorm about 60 us, against 10-20 us for an elementwise op (this project's 2-core CI machine).
So, on the CPU device only (on a GPU each is one kernel already):

- every `nn.RoPE` (the plain kind: dims, traditional, base, scale) rotates through the native
  `ops.rotary_embedding` over a table of each position's cosines and sines, computed once per
  load and shared by every layer with the same RoPE: 16 us for a query and a key at one row;
- every `nn.RMSNorm` runs MLX's own graph for it compiled into one function (`mx.compile`, the
  same ops, so the same values): about 25 us.

Subclasses, so code that asks `isinstance(m, nn.RoPE)` or reads their fields sees no difference;
other RoPE classes (scaled, M-RoPE, YaRN) and norms are left as they are.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_unflatten

from vllm_metal.ops import _backend, rotary_embedding


def install(model: nn.Module, max_position: int) -> int:
    """Swap `model`'s plain `nn.RoPE` and `nn.RMSNorm` modules for `TableRoPE` and
    `CompiledRMSNorm` (positions up to `max_position` - 1 in the tables: the engine's
    `max_model_len`). The RoPE swap needs the native extension (without it the ops' pure-MLX
    version would be no faster). Returns how many modules were swapped."""
    native = _backend.native()
    rope_native = native is not None and hasattr(native, "rotary_embedding")
    tables: dict[tuple, mx.array] = {}
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module) is nn.RMSNorm:
            swaps.append((name, CompiledRMSNorm.of(module)))
        elif type(module) is nn.RoPE and rope_native:
            key = (module.dims, module.base, module.scale)
            if key not in tables:
                tables[key] = rope_table(*key, max_position)
            swaps.append((name, TableRoPE(module, tables[key])))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def rope_table(dims: int, base: float, scale: float, max_position: int) -> mx.array:
    """`[max_position, dims]` float32: row p holds cos(scale * p * f_i) for i < dims / 2, then
    sin(scale * p * f_i), with f_i = base ** (-2 i / dims), computed with the float32 ops of
    MLX's own RoPE graph (f_i = exp(-i * ln(base) / (dims / 2))), so the rotations are the ones
    `mx.fast.rope` gives on the CPU."""
    half = dims // 2
    freqs = mx.exp(-mx.arange(half, dtype=mx.float32) * (math.log(base) / half))
    angles = (mx.arange(max_position, dtype=mx.float32) * scale)[:, None] * freqs[None, :]
    table = mx.concatenate([mx.cos(angles), mx.sin(angles)], axis=1)
    mx.eval(table)
    return table


class TableRoPE(nn.RoPE):
    """`nn.RoPE` through `ops.rotary_embedding` over a table of positions (`rope_table`):
    `x` `[B, ..., L, D]`, row b's token l at position offset[b] + l (offset an int or an array,
    one per row or one for all), as `mx.fast.rope` takes them. Positions past the table clamp
    to its last row."""

    def __init__(self, rope: nn.RoPE, table: mx.array):
        super().__init__(rope.dims, rope.traditional, rope.base, rope.scale)
        self._table = table  # private: not a parameter of the model

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        *lead, length, d = x.shape
        b = lead[0] if lead else 1
        heads = x.reshape(b, -1, length, d)  # [B, H, L, D]: H all the axes between
        steps = mx.arange(length, dtype=mx.int32)
        start = offset if isinstance(offset, mx.array) else mx.array(offset)
        start = start.astype(mx.int32).reshape(-1, 1)
        positions = mx.broadcast_to(start + steps, (b, length)).reshape(-1)
        rows = heads.transpose(0, 2, 1, 3).reshape(b * length, heads.shape[1], d)
        rotated, _ = rotary_embedding(
            positions, rows, rows[:, :0], self._table, not self.traditional
        )
        out = rotated.reshape(b, length, heads.shape[1], d).transpose(0, 2, 1, 3)
        return out.reshape(x.shape)


class CompiledRMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` with `mx.fast.rms_norm` compiled (`_compiled_rms_norm`)."""

    @classmethod
    def of(cls, norm: nn.RMSNorm) -> CompiledRMSNorm:
        swapped = cls(norm.weight.shape[0], norm.eps)
        swapped.weight = norm.weight
        return swapped

    def __call__(self, x: mx.array) -> mx.array:
        return _compiled_rms_norm(self.eps)(x, self["weight"])


@cache
def _compiled_rms_norm(eps: float):
    return mx.compile(lambda x, weight: mx.fast.rms_norm(x, weight, eps), shapeless=True)
