"""TurboQuant KV caches (``--kv-cache-dtype turboquant_k8v4 / turboquant_4bit_nc /
turboquant_k3v4_nc / turboquant_3bit_nc``): which layers store TurboQuant slots, their vLLM KV
specs, the pool that holds them and the layer caches that write and read them (`ops.turboquant`).

As in vLLM 0.32, the layers named by ``cache_config.kv_cache_dtype_skip_layers`` keep the model's
dtype: vLLM adds the first two and last two attention layers of a dense model to that list
whenever a TurboQuant format is asked for (a model of four layers or fewer keeps all of them, of
n layers the first and last min(2, n // 2)), and ``"sliding_window"`` there names every windowed
layer. A layer's index is its position among the decoder's attention layers (vLLM reads it from
the module name; the two agree for the decoders served). Every other layer's page holds, per
token and KV head, vLLM's slot (`ops.turboquant.codec`): keys in a uint8 key pool of
``key_bytes``, the rest in a value pool of ``value_bytes``, together the bytes vLLM sizes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import mlx.core as mx
import torch

from vllm_metal.kv.paged_cache import PagedLayerCache, StepMetadata
from vllm_metal.kv.pool import KVLayout, KVPool, uncommitted
from vllm_metal.models.layers import LayerKind, memory_layers
from vllm_metal.ops import turboquant
from vllm_metal.ops.cache import batched
from vllm_metal.ops.turboquant import TurboQuantFormat

if TYPE_CHECKING:
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

STORAGE_DTYPE = torch.uint8  # what vLLM's TurboQuant layers declare as their cache dtype
SKIP_SLIDING = "sliding_window"  # the skip-list entry that names every windowed layer


def requested(cache_dtype: str | None) -> bool:
    """Whether vLLM's cache_dtype names a TurboQuant preset."""
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS

    return cache_dtype in TQ_PRESETS


def head_size_problem(cache_dtype: str, head_dim: int) -> str | None:
    """Why `cache_dtype` cannot store heads of `head_dim`, or None: values pack 8 to a group of
    bytes, and MSE keys are rotated by a Hadamard matrix, which needs a power of two."""
    if head_dim % 8:
        return f"head size {head_dim} is not a multiple of 8"
    mse_keys = cache_dtype != "turboquant_k8v4"
    if mse_keys and head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two (the keys' Hadamard rotation)"
    return None


def format_for(cache_dtype: str, head_dim: int) -> TurboQuantFormat:
    """vLLM's preset `cache_dtype` at `head_dim`, with vLLM's own centroid table."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    problem = head_size_problem(cache_dtype, head_dim)
    if problem is not None:
        raise ValueError(f"--kv-cache-dtype {cache_dtype}: {problem}")
    config = TurboQuantConfig.from_cache_dtype(cache_dtype, head_dim)
    centroids = () if config.key_fp8 else tuple(get_centroids(head_dim, config.mse_bits).tolist())
    fmt = TurboQuantFormat(
        cache_dtype,
        head_dim,
        config.key_quant_bits,
        config.value_quant_bits,
        config.norm_correction,
        centroids,
    )
    assert fmt.slot_bytes == config.slot_size_aligned, (fmt, config.slot_size_aligned)
    return fmt


def quantized(index: int, kind: LayerKind, cache_config: CacheConfig) -> bool:
    """Whether attention layer `index` (of kind `kind`) stores TurboQuant slots."""
    skip = cache_config.kv_cache_dtype_skip_layers or []
    if kind.sliding_window is not None and SKIP_SLIDING in skip:
        return False
    return str(index) not in skip


def layer_spec(
    spec: KVCacheSpec, index: int, kind: LayerKind, cache_config: CacheConfig | None
) -> KVCacheSpec:
    """`spec` (an unquantized attention layer's) as vLLM's TurboQuant layers declare it where
    layer `index` is quantized: uint8, the preset's mode, one slot of bytes per token and head."""
    from vllm.v1.kv_cache_interface import AttentionSpec, get_kv_quant_mode

    if cache_config is None or not requested(cache_config.cache_dtype):
        return spec
    if not isinstance(spec, AttentionSpec) or not quantized(index, kind, cache_config):
        return spec
    fmt = format_for(cache_config.cache_dtype, spec.head_size)
    return replace(
        spec,
        dtype=STORAGE_DTYPE,
        kv_quant_mode=get_kv_quant_mode(cache_config.cache_dtype),
        state_content_bytes=fmt.slot_bytes,
    )


@dataclass(frozen=True)
class TurboQuantCache:
    """A TurboQuant cache: the preset and, per layer (model order), whether it is quantized."""

    kv_cache_dtype: str
    quantized: tuple[bool, ...]

    @classmethod
    def of(
        cls, cache_config: CacheConfig, kinds: Sequence[LayerKind], first_layer_index: int = 0
    ) -> TurboQuantCache:
        """The cache of layers `kinds`, the first numbered `first_layer_index` by vLLM."""
        flags = tuple(
            quantized(first_layer_index + i, kind, cache_config) for i, kind in enumerate(kinds)
        )
        return cls(str(cache_config.cache_dtype), flags)

    def layer_formats(
        self, kinds: Sequence[LayerKind], num_kv_heads: int, head_dim: int
    ) -> list[TurboQuantFormat | None]:
        """Each layer's format (a layer reading another's K/V: its writer's), None where the
        layer keeps the model's dtype or has no paged K/V."""
        out: list[TurboQuantFormat | None] = []
        for i in memory_layers(kinds):
            kind = kinds[i]
            if kind.is_state or kind.latent or not self.quantized[i]:
                out.append(None)
            else:
                out.append(
                    format_for(self.kv_cache_dtype, kind.kv_shape(num_kv_heads, head_dim)[1])
                )
        return out

    def pool(
        self,
        layout: KVLayout,
        kinds: Sequence[LayerKind],
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
    ) -> TurboQuantPool:
        shapes = [
            None if kind.is_state or kind.latent else kind.kv_shape(num_kv_heads, head_dim)
            for kind in kinds
        ]
        formats = self.layer_formats(kinds, num_kv_heads, head_dim)
        return TurboQuantPool(layout, num_kv_heads, head_dim, dtype, formats, shapes)


class TurboQuantPool(KVPool):
    """A `KVPool` whose quantized layers' regions hold TurboQuant bytes: keys ``[num_blocks,
    block_size, heads, fmt.key_bytes]`` and values ``[..., fmt.value_bytes]`` (uint8); the other
    regions are the model's dtype as in any pool. A region shared by layers whose pages differ
    (a boundary layer's float page beside slots, two head sizes) holds bytes, ``[num_blocks,
    bytes of the largest page]``, which each layer views (`KVPool.page_view`), as vLLM pads
    such pages. `layer_formats[i]`: layer i's format or None.
    `fresh[writer]`: the unquantized K/V rows layer `writer` wrote in the step of `fresh_step` (a
    prefill step; dropped when the next step writes), which a layer reading its pages attends
    over as vLLM's prefill does (`ops.turboquant`); keyed by layer, as layers of several groups
    may share a region."""

    def __init__(
        self,
        layout: KVLayout,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        layer_formats: Sequence[TurboQuantFormat | None],
        layer_shapes: Sequence[tuple[int, int] | None],
    ):
        self.layout = layout
        self.row_dtype = self.dtype = dtype
        self.layer_quant = None
        self.latent = False
        self.kv_shape = (num_kv_heads, head_dim)
        self.layer_formats = list(layer_formats)
        self.fresh: dict[int, tuple[mx.array, mx.array]] = {}
        self.fresh_step: StepMetadata | None = None
        # Each region's pages, per layer with KV memory: (key page, value page, dtype).
        block_sizes = layout.block_sizes()
        pages: list[set] = [set() for _ in range(layout.num_regions)]
        for i, shape in enumerate(layer_shapes):
            if shape is None:
                continue
            fmt, block = self.layer_formats[i], block_sizes[layout.group_of_layer[i]]
            if fmt is None:
                page = ((block, *shape), (block, *shape), dtype)
            else:
                rows = (block, shape[0])
                page = ((*rows, fmt.key_bytes), (*rows, fmt.value_bytes), mx.uint8)
            pages[layout.region_of_layer[i]].add(page)
        self.keys, self.values = [], []
        for region, kinds in enumerate(pages):
            if not kinds:
                shape = (layout.block_size, num_kv_heads, head_dim)
                kinds = {(shape, shape, dtype)}
            sizes = {(math.prod(k) * t.size, math.prod(v) * t.size) for k, v, t in kinds}
            if len(sizes) == 1 and len({t for _, _, t in kinds}) == 1:
                key_page, value_page, page_dtype = next(iter(kinds))
                self.keys.append(uncommitted((layout.num_blocks, *key_page), page_dtype))
                self.values.append(uncommitted((layout.num_blocks, *value_page), page_dtype))
                continue
            # Pages of several sizes or dtypes (boundary layers' float pages beside slots, two
            # head sizes): vLLM pads them to the largest; each layer views the start of a page.
            for arrays, side in ((self.keys, 0), (self.values, 1)):
                widest = max(size[side] for size in sizes)
                arrays.append(uncommitted((layout.num_blocks, widest), mx.uint8))
        self._zero_block(0)
        mx.eval(self.keys, self.values)

    def _zero_block(self, block: int) -> None:
        """Zero one block of every region (all-zero bytes read as zero keys and values)."""
        for i, (keys, values) in enumerate(zip(self.keys, self.values)):
            shapes = keys.shape, values.shape
            if keys.ndim == 2:  # padded pages: one row of a page's bytes
                keys, values = keys[:, None, None], values[:, None, None]
            block_size = keys.shape[1]
            slots = mx.arange(block * block_size, (block + 1) * block_size, dtype=mx.int64)
            kc, vc = batched.reshape_and_cache(
                mx.zeros((block_size, *keys.shape[2:]), keys.dtype),
                mx.zeros((block_size, *values.shape[2:]), values.dtype),
                keys,
                values,
                slots,
                padded=False,
            )
            self.keys[i], self.values[i] = kc.reshape(shapes[0]), vc.reshape(shapes[1])


class TurboQuantLayerCache(PagedLayerCache):
    """A quantized layer's paged view: writes quantize (`ops.turboquant.reshape_and_cache`),
    attention dequantizes the pages it reads (`ops.turboquant.paged_attention`)."""

    def __init__(self, pool: TurboQuantPool, fmt: TurboQuantFormat, writer: int, *args, **kwargs):
        super().__init__(pool, *args, **kwargs)
        self.fmt = fmt
        self.writer = writer  # the layer whose pages these are (itself, or its `kv_source`)

    def _slots(self, arrays: list[mx.array], width: int) -> mx.array:
        """The region's key or value slots as `[num_blocks, block size, heads, width]` bytes."""
        block_size, heads, _ = self.page_shape
        return KVPool.page_view(arrays[self.region], block_size, heads, width, mx.uint8)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if not self.writes:
            return keys, values
        t, h, _, d = keys.shape  # [T, H_kv, 1, D]
        rows = (keys.reshape(t, h, d), values.reshape(t, h, d))
        kc, vc = turboquant.reshape_and_cache(
            *rows,
            self._slots(self.pool.keys, self.fmt.key_bytes),
            self._slots(self.pool.values, self.fmt.value_bytes),
            self.tables.slot_mapping,
            fmt=self.fmt,
            padded=not self.meta.decode,
        )
        pool = self.pool
        in_place = functools.partial(turboquant.writes_in_place, self.fmt)
        pool.keys[self.region] = KVPool.written(pool.keys[self.region], kc, in_place)
        pool.values[self.region] = KVPool.written(pool.values[self.region], vc, in_place)
        if self.pool.fresh_step is not self.meta:
            self.pool.fresh_step, self.pool.fresh = self.meta, {}
        if not self.meta.decode:
            self.pool.fresh[self.writer] = rows
        return keys, values

    def attend(
        self,
        queries: mx.array,
        scale: float,
        sinks: mx.array | None,
        softcap: float | None = None,
    ) -> mx.array:
        if self.key_ends is not None:
            raise ValueError("a TurboQuant cache has no rows attended both ways (media)")
        t, h, _, d = queries.shape  # [T, H_q, 1, D]
        fresh = None
        if not self.meta.decode and self.pool.fresh_step is self.meta:
            fresh = self.pool.fresh.get(self.writer)
        out = turboquant.paged_attention(
            queries.reshape(t, h, d),
            self._slots(self.pool.keys, self.fmt.key_bytes),
            self._slots(self.pool.values, self.fmt.value_bytes),
            self.tables.block_tables,
            self.meta.seq_lens,
            self.meta.cu_seqlens_q,
            fmt=self.fmt,
            scale=float(scale),
            sliding_window=self.sliding_window,
            softcap=softcap,
            sinks=None if sinks is None else sinks.astype(mx.float32),
            key=None if fresh is None else fresh[0],
            value=None if fresh is None else fresh[1],
            max_query_len=1 if self.meta.decode else None,
        )
        return out.reshape(t, h, 1, d).astype(queries.dtype)


def layer_cache(
    pool: TurboQuantPool,
    layer: int,
    kind: LayerKind,
    meta: StepMetadata,
    bidirectional: bool,
) -> PagedLayerCache:
    """Layer `layer`'s view of the step: a `TurboQuantLayerCache` where it is quantized, the
    plain paged view of its float region otherwise."""
    layout = pool.layout
    group = layout.group_of_layer[layer]
    args = (
        layout.region_of_layer[layer],
        meta,
        meta.groups[group],
        kind.sliding_window,
    )
    options = {
        "page_shape": (layout.block_sizes()[group], *kind.kv_shape(*pool.kv_shape)),
        "writes": kind.kv_source is None,
        "bidirectional": bidirectional,
    }
    fmt = pool.layer_formats[layer]
    if fmt is None:
        return PagedLayerCache(pool, *args, **options)
    writer = layer if kind.kv_source is None else kind.kv_source
    return TurboQuantLayerCache(pool, fmt, writer, *args, **options)


__all__ = [
    "TurboQuantCache",
    "TurboQuantLayerCache",
    "TurboQuantPool",
    "format_for",
    "layer_cache",
    "layer_spec",
    "requested",
]
