"""The paged-attention path swapped into mlx-lm models.

The runner packs every scheduled token of a step into a batch of T rows of length 1
(`[T, 1, hidden]`), so RoPE takes one position per row and the model's own layers run unchanged.
Each attention layer gets a `PagedLayerCache` as its "cache": mlx-lm calls
`cache.update_and_fetch`, which writes K/V into the paged pools, and then its
`scaled_dot_product_attention`, which we route to `vllm_metal.ops.paged_attention`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from vllm_metal import ops


@dataclass
class StepMetadata:
    """Varlen batch of one step (DESIGN.md contract), already on the MLX device."""

    positions: mx.array  # [T] int32, position of each packed token in its sequence
    slot_mapping: mx.array  # [T] int64, KV slot each token writes (negative = skip)
    block_tables: mx.array  # [S, max_blocks] int32
    seq_lens: mx.array  # [S] int32, context length after this step
    cu_seqlens_q: mx.array  # [S+1] int32


class KVPool:
    """Per-layer K and V pools `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (copy-on-write of shared blocks)."""
        if not src:
            return
        src_idx = mx.array(src, dtype=mx.int32)
        dst_idx = mx.array(dst, dtype=mx.int32)
        for pools in (self.keys, self.values):
            for i, pool in enumerate(pools):
                pool[dst_idx] = pool[src_idx]
                pools[i] = pool
        mx.eval(self.arrays())


class PagedLayerCache:
    """What one attention layer sees as its cache during a step."""

    def __init__(self, pool: KVPool, layer: int, meta: StepMetadata, sliding_window: int | None):
        self.pool = pool
        self.layer = layer
        self.meta = meta
        self.sliding_window = sliding_window

    @property
    def offset(self) -> mx.array:
        # mlx-lm's RoPE takes a per-batch-row offset; each packed row is one token.
        return self.meta.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        t, h, _, d = keys.shape  # [T, H_kv, 1, D]
        kc, vc = ops.reshape_and_cache(
            keys.reshape(t, h, d),
            values.reshape(t, h, d),
            self.pool.keys[self.layer],
            self.pool.values[self.layer],
            self.meta.slot_mapping,
        )
        self.pool.keys[self.layer] = kc
        self.pool.values[self.layer] = vc
        return keys, values

    def attend(
        self,
        queries: mx.array,
        scale: float,
        sinks: mx.array | None,
        softcap: float | None = None,
    ) -> mx.array:
        t, h, _, d = queries.shape  # [T, H_q, 1, D]
        out = ops.paged_attention(
            queries.reshape(t, h, d),
            self.pool.keys[self.layer],
            self.pool.values[self.layer],
            self.meta.block_tables,
            self.meta.seq_lens,
            self.meta.cu_seqlens_q,
            scale=float(scale),
            sliding_window=self.sliding_window,
            softcap=softcap,
            sinks=None if sinks is None else sinks.astype(mx.float32),
        )
        return out.reshape(t, h, 1, d)


def _make_paged_sdpa(original: Any):
    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask=None, sinks=None, **kwargs
    ):
        if isinstance(cache, PagedLayerCache):
            return cache.attend(queries, scale, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)

    scaled_dot_product_attention.__vllm_metal_paged__ = True
    return scaled_dot_product_attention


def install_paged_attention(model: Any) -> None:
    """Route the model module's attention through the paged ops when given a PagedLayerCache.

    Only calls that carry a PagedLayerCache change; plain mlx-lm use in the same process is
    unaffected.
    """
    from vllm_metal.runner.families import adapter_for

    module = sys.modules[type(model).__module__]
    adapter = adapter_for(module)
    if adapter is not None:
        adapter.install(module)
        return
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is None:
        raise ValueError(
            f"{module.__name__}: this mlx-lm architecture computes attention without "
            "scaled_dot_product_attention and is not supported by vllm-metal yet"
        )
    if not getattr(current, "__vllm_metal_paged__", False):
        module.scaled_dot_product_attention = _make_paged_sdpa(current)


def layer_sliding_windows(hf_text_config: Any, num_layers: int) -> list[int | None]:
    """Sliding window per layer, as transformers applies it (None = full attention)."""
    window = getattr(hf_text_config, "sliding_window", None)
    layer_types = getattr(hf_text_config, "layer_types", None)
    if not window:
        return [None] * num_layers
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers]]
    if getattr(hf_text_config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [int(window)] * num_layers


class HiddenPassthrough:
    """Stands in for `model.model` so the outer model only applies its LM head (+ softcap).

    mlx-lm's `Model.__call__` is `head(self.model(inputs, cache))`; swapping the inner model for
    this object for one call turns it into `head(hidden)` for the rows we picked, without
    per-architecture code for tied embeddings or logit softcapping.
    """

    def __init__(self, inner: Any, hidden: mx.array):
        self._inner = inner
        self._hidden = hidden

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self._hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def apply_lm_head(model: Any, hidden: mx.array) -> mx.array:
    inner = model["model"]
    model["model"] = HiddenPassthrough(inner, hidden)
    try:
        return model(None)
    finally:
        model["model"] = inner
