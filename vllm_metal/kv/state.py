"""Recurrent-state memory of hybrid models (Gated DeltaNet or Mamba-2 layers between attention
layers).

vLLM manages a state layer like an attention layer with a `MambaSpec`: its group's block table
gives each running request one state block, allocated when the request is scheduled and freed
when it finishes or is preempted (vLLM's "none" mamba cache mode: prefix caching is off for
hybrids, so a preempted request recomputes its prompt). vLLM lays the state groups over the same
memory as the attention groups, one page per block id, which is sound because a block id belongs
to one group at a time. So a state layer keeps its pages in the K/V pools of the region it
shares: block `b`'s page is the bytes of `keys[region][b]` followed by those of
`values[region][b]`, holding the float32 recurrent state (`StateShapes.recurrent`) and then the
convolution window `[K-1, conv_dim]` in the cache dtype. Pages are read by gathering those rows and written
with `ops.reshape_and_cache` (a block's tokens are the page's rows), which copies bytes as they
are, in place.

For that to fit, an attention page (`block_size` tokens of K and V) must hold a state page:
`align_block_size` (the MLX backend's `configure_hybrid`) raises the block size before vLLM builds
its scheduler, and tells vLLM to pad the state page to the attention page so both kinds of group
share one block pool. The state dtypes it assumes are checked first (`config.startup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from vllm_metal import ops
from vllm_metal._logging import init_logger
from vllm_metal.models.layers import RECURRENT_DTYPE, StateShapes, state_shapes_of

if TYPE_CHECKING:
    from vllm.config import CacheConfig, VllmConfig

    from vllm_metal.kv.pool import KVPool

logger = init_logger(__name__)

# Attention block sizes stay multiples of this when raised to hold a state page.
_BLOCK_ALIGN = 16
# Pages are moved in words of this type (bits as they are).
_WORD = mx.uint32


def align_block_size(vllm_config: VllmConfig) -> None:
    """Make room for a hybrid model's state pages in the KV blocks (see the module docstring)."""
    from vllm.utils.torch_utils import get_dtype_size

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf = model.hf_text_config.to_dict()
    shapes = state_shapes_of(hf.get("model_type", ""), hf)
    if cache.enable_prefix_caching:
        logger.info(
            "vllm-metal: prefix caching is off for the hybrid model %r: its state layers keep "
            "one state per request, not per cached block (--no-enable-prefix-caching)",
            model.model,
        )
        cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len
    itemsize = get_dtype_size(model.dtype)
    token_bytes = (
        2 * model.get_num_kv_heads(vllm_config.parallel_config) * (model.get_head_size() * itemsize)
    )
    state_bytes = shapes.page_bytes(itemsize)
    align = _BLOCK_ALIGN * token_bytes
    needed = _BLOCK_ALIGN * (-(-state_bytes // align))
    if cache.block_size < needed:
        logger.info(
            "vllm-metal: KV block size %d -> %d tokens so that a block holds a state page "
            "(%d bytes) of model %r",
            cache.block_size,
            needed,
            state_bytes,
            model.model,
        )
        cache.block_size = needed
    cache.mamba_page_size_padded = cache.block_size * token_bytes


_MAMBA_TYPES = {"gated_delta": "GDN_ATTN", "mamba2": "MAMBA2"}


def mamba_spec(shapes: StateShapes, dtype: Any, cache: CacheConfig):
    """vLLM's spec of one state layer (`dtype`: the torch cache dtype of the conv window), as
    `align_block_size` set the cache config up."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        shapes=(shapes.conv, shapes.recurrent),
        dtypes=(dtype, torch.float32),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum[_MAMBA_TYPES[shapes.mixer]],
        mamba_cache_mode=cache.mamba_cache_mode,
    )


class StateLayerCache:
    """What one state layer sees during a step: its requests' state pages in the pool."""

    def __init__(
        self,
        pool: KVPool,
        region: int,
        shapes: StateShapes,
        blocks: np.ndarray,
        fresh: np.ndarray,
        cu_seqlens: mx.array,
    ):
        self.pool = pool
        self.region = region
        self.shapes = shapes
        self.blocks = blocks  # [S] host ints: each request's state block
        self.fresh = fresh  # [S] host bools: the request starts from a zero state
        self.cu_seqlens = cu_seqlens  # [S+1] int32

    # A page is handled in 4-byte words (never converted, so any bit pattern survives), and
    # only the token rows of a block that hold state are read or written: the K rows first,
    # then as many V rows as the rest needs (the padding vLLM counts is left alone).

    def _layout(self) -> tuple[int, int, int, int]:
        """Words per token row, token rows holding state in K and in V, conv window words."""
        _, block_size, heads, head_dim = self.pool.keys[self.region].shape
        row_words = heads * head_dim * self.pool.dtype.size // _WORD.size
        conv_words = -(-int(np.prod(self.shapes.conv)) * self.pool.dtype.size // _WORD.size)
        used = self.shapes.recurrent_bytes() // _WORD.size + conv_words
        rows = -(-used // row_words)
        return row_words, min(rows, block_size), max(0, rows - block_size), conv_words

    def read(self) -> tuple[mx.array, mx.array]:
        """Each request's convolution window `[S, K-1, C]` (cache dtype) and recurrent state
        (float32); zeros for fresh requests."""
        num = len(self.blocks)
        idx = mx.array(self.blocks.astype(np.int32))
        _, k_rows, v_rows, conv_words = self._layout()

        def words(pool: mx.array, rows: int) -> mx.array:
            return mx.view(pool[idx, :rows], _WORD).reshape(num, -1)

        page = words(self.pool.keys[self.region], k_rows)
        if v_rows:
            page = mx.concatenate([page, words(self.pool.values[self.region], v_rows)], axis=1)
        split = self.shapes.recurrent_bytes() // _WORD.size
        recurrent = mx.view(page[:, :split], RECURRENT_DTYPE).reshape(num, *self.shapes.recurrent)
        conv = mx.view(page[:, split : split + conv_words], self.pool.dtype)
        conv = conv[:, : int(np.prod(self.shapes.conv))].reshape(num, *self.shapes.conv)
        if self.fresh.any():
            keep = mx.array(~self.fresh)
            recurrent = mx.where(keep[:, None, None, None], recurrent, 0)
            conv = mx.where(keep[:, None, None], conv, 0)
        return conv, recurrent

    def write(self, conv: mx.array, recurrent: mx.array) -> None:
        """Store each request's new window and state in its page (in place)."""
        keys, values = self.pool.keys[self.region], self.pool.values[self.region]
        num = len(self.blocks)
        _, block_size, heads, head_dim = keys.shape
        row_words, k_rows, _, conv_words = self._layout()
        conv = conv.astype(self.pool.dtype).reshape(num, -1)
        pad = conv_words * _WORD.size // self.pool.dtype.size - conv.shape[1]
        if pad:
            conv = mx.concatenate([conv, mx.zeros((num, pad), dtype=conv.dtype)], axis=1)
        parts = [
            mx.view(recurrent.astype(RECURRENT_DTYPE), _WORD).reshape(num, -1),
            mx.view(conv, _WORD),
        ]
        # K and V take the same slots, so the V part is padded to the K rows.
        used = sum(p.shape[1] for p in parts)
        parts.append(mx.zeros((num, (k_rows + k_rows) * row_words - used), dtype=_WORD))
        page = mx.concatenate(parts, axis=1)

        def rows(part: mx.array) -> mx.array:
            return mx.view(part, self.pool.dtype).reshape(num * k_rows, heads, head_dim)

        half = k_rows * row_words
        slots = self.blocks.astype(np.int64)[:, None] * block_size + np.arange(k_rows)
        kc, vc = ops.reshape_and_cache(
            rows(page[:, :half]), rows(page[:, half:]), keys, values, mx.array(slots.reshape(-1))
        )
        self.pool.keys[self.region] = kc
        self.pool.values[self.region] = vc
