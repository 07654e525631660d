"""Paged K/V arrays laid out as vLLM's `KVCacheConfig` describes them.

vLLM sizes the cache and decides which layers share memory: with several KV-cache groups (e.g.
sliding-window and full-attention layers) one layer of each group overlays the same region, which
is sound because a block id belongs to one group at a time. Here every region is one K and one V
array `[num_blocks, block_size, num_kv_heads, head_dim]` (vLLM's `LBNHC` layout, K and V apart),
and each layer knows its region (memory) and its group (block table). A hybrid model's state
layers keep their pages in the same regions (`kv.state`); their groups count one block per
request (block size `max_model_len`), so `block_size` here is the attention groups'.
The arrays are allocated without being written, so the device commits a page only when a step
first writes into it: an idle server holds little of its pool (`uncommitted`). Their contents
start undefined; nothing reads a slot before it is written (the attention ops stop at each
sequence's length, state layers of new requests read zeros) except block 0, vLLM's null block,
which block tables name for blocks a sliding window has dropped: it is zeroed.

A latent-attention (MLA) model's regions are one array each, `[num_blocks, block_size, head_dim]`
(`kv.latent`): its row is both key and value, and vLLM's `MLAAttentionSpec` sizes no values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

if TYPE_CHECKING:
    from vllm_metal.kv.quant import KVCacheQuant
    from vllm_metal.kv.turboquant import TurboQuantCache
    from vllm_metal.models.layers import LayerKind
    from vllm_metal.ops.fp8 import KVQuant
    from vllm_metal.ops.per_token_head import PerTokenHeadQuant


@dataclass(frozen=True)
class KVLayout:
    """Where each attention layer's K/V live and which block table it reads."""

    num_blocks: int
    block_size: int
    region_of_layer: tuple[int, ...]
    group_of_layer: tuple[int, ...]
    # Tokens per block of each group's table (`block_size`, a state group's its own); empty:
    # every group has `block_size`.
    group_block_sizes: tuple[int, ...] = ()

    @property
    def num_regions(self) -> int:
        return max(self.region_of_layer, default=-1) + 1

    @property
    def num_groups(self) -> int:
        return max(self.group_of_layer, default=-1) + 1

    def block_sizes(self) -> list[int]:
        """Tokens per block of each group's block table."""
        return list(self.group_block_sizes) or [self.block_size] * self.num_groups

    def group_windows(self, kinds: Sequence[LayerKind]) -> list[int | None]:
        """Each group's sliding window (its layers', `kinds` in layer order), None where any of
        its layers attends to the whole context or keeps a state."""
        windows: list[set] = [set() for _ in range(self.num_groups)]
        for kind, group in zip(kinds, self.group_of_layer):
            windows[group].add(None if kind.is_state else kind.sliding_window)
        return [next(iter(w)) if len(w) == 1 else None for w in windows]

    @classmethod
    def single_group(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        memory_of: Sequence[int] | None = None,
    ) -> KVLayout:
        """Every layer in its own region, one block table (profiling and warm-up); with
        `memory_of` (the layer whose memory each layer uses), a layer reading another's K/V reads
        that layer's region."""
        memory_of = range(num_layers) if memory_of is None else memory_of
        regions = {layer: r for r, layer in enumerate(sorted(set(memory_of)))}
        region_of_layer = tuple(regions[layer] for layer in memory_of)
        return cls(num_blocks, block_size, region_of_layer, (0,) * len(memory_of))

    @classmethod
    def from_config(cls, config: KVCacheConfig, layer_names: Sequence[str]) -> KVLayout:
        """Read vLLM's allocation plan for the given layers (in model order)."""
        group_of: dict[str, int] = {}
        block_sizes = set()
        group_block_sizes = []
        for g, group in enumerate(config.kv_cache_groups):
            spec = group.kv_cache_spec
            # Layers of one kind but different shapes (a draft model's beside the target's)
            # share a group as UniformTypeKVCacheSpecs.
            members = (
                spec.kv_cache_specs.values()
                if isinstance(spec, UniformTypeKVCacheSpecs)
                else [spec]
            )
            kinds = (AttentionSpec, MambaSpec)
            odd = [type(m).__name__ for m in members if not isinstance(m, kinds)]
            if odd:
                raise ValueError(
                    f"KV-cache group {g} has spec {odd[0]}; "
                    "vllm-metal allocates attention KV caches and GDN states only"
                )
            if not isinstance(spec, MambaSpec):
                block_sizes.add(spec.block_size)
            group_block_sizes.append(spec.block_size)
            for name in group.layer_names:
                group_of[name] = g
        if not block_sizes:
            raise ValueError("vLLM's KV-cache config has no attention group")
        # Groups of narrower rows than the widest hold more tokens per block (vLLM unifies their
        # page sizes that way); the widest rows' groups keep the configured block size.
        block_size = min(block_sizes)

        offset_of: dict[str, int] = {}
        for tensor in config.kv_cache_tensors:
            for i, name in enumerate(tensor.layers):
                offset_of[name] = tensor.offset + i * tensor.layer_stride
        missing = [n for n in layer_names if n not in offset_of or n not in group_of]
        if missing:
            raise ValueError(f"vLLM's KV-cache config has no memory for layers {missing}")
        # Layers whose pages start at the same byte alias one region. Only the given layers
        # count: the config may also hold another model's layers (a draft model's).
        offsets = sorted({offset_of[n] for n in layer_names})
        regions = {offset: r for r, offset in enumerate(offsets)}
        return cls(
            num_blocks=config.num_blocks,
            block_size=block_size,
            region_of_layer=tuple(regions[offset_of[n]] for n in layer_names),
            group_of_layer=tuple(group_of[n] for n in layer_names),
            group_block_sizes=tuple(group_block_sizes),
        )


def uncommitted(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """An array of `shape` whose memory is reserved but not written, so its pages are committed
    as they are first written; contents undefined. Zeros (committed at once) without the native
    extension."""
    from vllm_metal.ops._backend import loaded_native

    native = loaded_native()
    if native is None:
        return mx.zeros(shape, dtype=dtype)
    raw = native.uncommitted_bytes([*shape[:-1], shape[-1] * dtype.size])
    return mx.view(raw, dtype)


class KVPool:
    """K and V arrays per region, `[num_blocks, block_size, num_kv_heads, head_dim]`; with
    `latent`, one array per region in `keys`, `[num_blocks, block_size, head_dim]`, and no
    `values`.

    Layers with their own KV heads and head size (`layer_shapes[i]`, None for the model's or a
    state layer) read their region in their shape, `[num_blocks, their group's block size, heads,
    head size]` (`page_view`): vLLM gives every layer sharing a region pages of one size, so only
    the rows per page differ. A region is allocated in the shape of its first such layer. Where
    the layers' pages are no whole multiple of each other (Gemma 4's two head sizes with each
    row's scale beside it), vLLM pads the smaller pages to the largest (`page_size_padded`): the
    region is then `[num_blocks, elements of the largest page]` and a layer reads the start of
    each page (a view with gaps between blocks, which the native ops read and write in place).

    `layer_quant` (one per layer, `kv.quant`): a quantized cache, whose arrays are uint8 bytes;
    `row_dtype` is then the dtype rows are written from and queries read in (`dtype` otherwise).
    A per-token-head cache's rows are its stored rows, data and scale
    (`ops.per_token_head.row_bytes`): `stored_shape` says their shape."""

    def __init__(
        self,
        layout: KVLayout,
        num_kv_heads: int,
        head_dim: int,
        dtype: mx.Dtype,
        *,
        latent: bool = False,
        layer_shapes: Sequence[tuple[int, int] | None] = (),
        layer_quant: Sequence[KVQuant | PerTokenHeadQuant] | None = None,
    ):
        self.layout = layout
        self.row_dtype = dtype
        self.layer_quant = None if layer_quant is None else list(layer_quant)
        if self.layer_quant is not None:
            if latent:
                raise ValueError("a latent (MLA) cache cannot be quantized")
            dtype = mx.uint8
        self.dtype = dtype
        self.latent = latent
        self.kv_shape = (num_kv_heads, head_dim)  # the model's: layers without their own
        if latent:
            if num_kv_heads != 1:
                raise ValueError(f"a latent (MLA) cache has one KV head, got {num_kv_heads}")
            shapes: list[tuple[int, ...]] = [(layout.block_size, head_dim)] * layout.num_regions
        else:
            stored = [
                None if shape is None else self.stored_shape(*shape) for shape in layer_shapes
            ]
            default = self.stored_shape(num_kv_heads, head_dim)
            shapes = self._region_shapes(layout, default, stored)
        self.keys = [uncommitted((layout.num_blocks, *shape), dtype) for shape in shapes]
        self.values = (
            [] if latent else [uncommitted((layout.num_blocks, *shape), dtype) for shape in shapes]
        )
        self._zero_block(0)
        mx.eval(self.keys, self.values)

    def stored_shape(self, heads: int, head_dim: int) -> tuple[int, int]:
        """(heads, elements per stored row) of a layer whose rows are `head_dim` wide: a
        per-token-head cache stores bytes of data and a scale per row."""
        row_bytes = getattr(self.layer_quant[0], "row_bytes", None) if self.layer_quant else None
        return (heads, head_dim if row_bytes is None else row_bytes(head_dim))

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def over(self, keys: Sequence[mx.array], values: Sequence[mx.array]) -> KVPool:
        """This pool's layout and dtypes over other arrays of the same shapes (the traced inputs
        of a compiled step): what the layers write goes to the returned pool's lists."""
        view = copy.copy(self)
        view.keys, view.values = list(keys), list(values)
        return view

    @staticmethod
    def _region_shapes(
        layout: KVLayout,
        default: tuple[int, int],
        layer_shapes: Sequence[tuple[int, int] | None],
    ) -> list[tuple[int, ...]]:
        """Each region's shape past its block axis: its first layer's `(block size, heads, row)`,
        or `(elements,)` of the largest page where its layers' pages differ in size (padded)."""
        shapes: list[tuple[int, ...] | None] = [None] * layout.num_regions
        block_sizes = layout.block_sizes()
        for i, layer_shape in enumerate(layer_shapes):
            if layer_shape is None:
                continue
            region = layout.region_of_layer[i]
            shape = (block_sizes[layout.group_of_layer[i]], *layer_shape)
            first = shapes[region]
            if first is None:
                shapes[region] = shape
            elif np.prod(first) != np.prod(shape):
                shapes[region] = (int(max(np.prod(first), np.prod(shape))),)
        return [shape or (layout.block_size, *default) for shape in shapes]

    @staticmethod
    def page_view(
        array: mx.array, block_size: int, heads: int, head_dim: int, dtype: mx.Dtype | None = None
    ) -> mx.array:
        """A region's K or V array as `[num_blocks, block_size, heads, head_dim]`: itself when it
        has that shape, else a view of the same memory, which the paged ops write in place (a
        reshape; of a padded region, the start of each page, its bytes read as `dtype`)."""
        shape = (array.shape[0], block_size, heads, head_dim)
        if array.shape == shape:
            return array
        if array.ndim == 2:  # padded pages
            if dtype is not None and dtype != array.dtype:
                array = mx.view(array, dtype)
            return array[:, : block_size * heads * head_dim].reshape(shape)
        return array.reshape(shape)

    @staticmethod
    def written(region: mx.array, pages: mx.array, in_place: Callable[[], bool]) -> mx.array:
        """The region array after a write returned `pages` (its `page_view`, written): `pages`
        itself where the view is the region, else the region's memory ordered after the write
        (`in_place()`: the op wrote into the view's memory; asked of padded regions only, as it
        reads the ops' settings) or with the written pages copied in."""
        if region.ndim != 2 or pages.ndim == 2:
            return pages.reshape(region.shape)
        if in_place():
            return mx.depends(region, pages)
        rows = mx.view(pages.reshape(pages.shape[0], -1), region.dtype)
        region[:, : rows.shape[1]] = rows
        return region

    def _zero_block(self, block: int) -> None:
        """Zero one block in every region, in place (the rest stays uncommitted); a no-op
        without the native extension, whose pools start as zeros. Zero bytes are +0.0 in fp8:
        an fp8 pool's block is written with MLX's own ops (the kernels take float pools)."""
        from vllm_metal.ops._backend import loaded_native
        from vllm_metal.ops.cache import batched

        native = loaded_native()
        if native is None:
            return
        writer = native if self.layer_quant is None else batched
        for i, region in enumerate(self.keys):
            # A padded region (`_region_shapes`) is zeroed as one row of a page's elements.
            keys = region[:, None, None] if region.ndim == 2 else region
            block_size = keys.shape[1]
            slots = mx.arange(block * block_size, (block + 1) * block_size, dtype=mx.int64)
            rows = mx.zeros((block_size, *keys.shape[2:]), dtype=self.dtype)
            if self.latent:
                self.keys[i] = native.mla_reshape_and_cache(rows, keys, slots)
            else:
                values = self.values[i].reshape(keys.shape)
                kc, vc = writer.reshape_and_cache(rows, rows, keys, values, slots)
                self.keys[i], self.values[i] = kc.reshape(region.shape), vc.reshape(region.shape)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every region (copy-on-write of shared blocks)."""
        if not src:
            return
        src_idx = mx.array(src, dtype=mx.int32)
        dst_idx = mx.array(dst, dtype=mx.int32)
        for arrays in (self.keys, self.values):
            for i, pool in enumerate(arrays):
                pool[dst_idx] = pool[src_idx]
                arrays[i] = pool
        mx.eval(self.arrays())


def pool_for(
    layout: KVLayout,
    kinds: Sequence[LayerKind],
    num_kv_heads: int,
    head_dim: int,
    dtype: mx.Dtype,
    quant: KVCacheQuant | TurboQuantCache | None = None,
) -> KVPool:
    """The pool of a decoder whose layers are `kinds`, laid out by `layout`; `quant`: an fp8
    cache (`kv.quant`), rows of `dtype` stored as bytes, or a TurboQuant one (`kv.turboquant`)."""
    from vllm_metal.kv.turboquant import TurboQuantCache

    if isinstance(quant, TurboQuantCache):
        return quant.pool(layout, kinds, num_kv_heads, head_dim, dtype)
    shapes = [
        None if kind.is_state or kind.latent else kind.kv_shape(num_kv_heads, head_dim)
        for kind in kinds
    ]
    latent = next((kind for kind in kinds if kind.latent), None)
    if latent is not None:
        # A latent cache's rows are its layers' own shape (`kv.latent`), where they declare one.
        num_kv_heads, head_dim = latent.kv_shape(num_kv_heads, head_dim)
    return KVPool(
        layout,
        num_kv_heads,
        head_dim,
        dtype,
        latent=latent is not None,
        layer_shapes=shapes,
        layer_quant=None if quant is None else quant.layer_reads(kinds),
    )
