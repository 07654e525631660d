"""Recurrent-state memory of hybrid models (Gated DeltaNet or Mamba-2 layers between attention
layers).

vLLM manages a state layer like an attention layer with a `MambaSpec`, and lays the state groups
over the same memory as the attention groups, one page per block id, which is sound because a
block id belongs to one group at a time. So a state layer keeps its pages in the K/V pools of the
region it shares: block `b`'s page is the bytes of `keys[region][b]` followed by those of
`values[region][b]`, holding the float32 recurrent state (`StateShapes.recurrent`) and then the
convolution window `[K-1, conv_dim]` in the model's dtype, also beside a quantized cache
(`kv.quant`: the attention pages alone hold its bytes). Pages are read by gathering those rows
and written with `ops.reshape_and_cache` (a block's tokens are the page's rows; over a quantized
cache's byte pools, its pure-MLX scatter), which copies bytes as they are, in place. Beside MLA layers (Kimi-Linear) the region is the latent cache's one
array: the page is its rows alone, written with `ops.mla_reshape_and_cache`.

Which page a step reads and which it writes follow vLLM's two mamba cache modes, through one
rule: a request's state after `n` tokens lives in column `ceil(n / B) - 1` of its state group's
block table, `B` being that group's block size.
- "none" (prefix caching off): `B` is `max_model_len`, so each request has one state block, read
  and written in place every step; a preempted request recomputes its prompt.
- "align" (prefix caching on): `B` is the attention block size. vLLM's scheduler ends prompt
  chunks on block boundaries, so the state after a block's last token is left in that block's
  page, which vLLM then caches with the block's hash. A step reads the state where the previous
  step left it (column `ceil(computed / B) - 1`) and writes it to the column of its last token,
  so a page that holds a boundary state is never written again; a prefix hit of `n` tokens
  starts from the page of the hit's last block. Hits are exact: the state is the one the
  uncached request had at that token.

For that to fit, an attention page (`block_size` tokens of K and V) must hold a state page:
`align_block_size` (the MLX backend's `configure_hybrid`) raises the block size before vLLM builds
its scheduler, and tells vLLM to pad the state page to the attention page so both kinds of group
share one block pool. The state dtypes it assumes are checked first (`config.startup`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from vllm_metal import ops
from vllm_metal._logging import init_logger
from vllm_metal.models.layers import RECURRENT_DTYPE, StateShapes, state_shapes_of
from vllm_metal.ops.cache.batched import reshape_and_cache as batched_write

if TYPE_CHECKING:
    from vllm.config import CacheConfig, VllmConfig

    from vllm_metal.kv.pool import KVPool
    from vllm_metal.kv.state_drafts import StepDrafts

logger = init_logger(__name__)

# Attention block sizes stay multiples of this when raised to hold a state page.
_BLOCK_ALIGN = 16
# Pages are moved as bytes of this type (bits as they are: a TurboQuant pool's rows need not be
# whole 4-byte words).
_WORD = mx.uint8


def align_block_size(vllm_config: VllmConfig) -> None:
    """Make room for a hybrid model's state pages in the KV blocks and pick vLLM's mamba cache
    mode (see the module docstring)."""
    from vllm.utils.torch_utils import get_dtype_size

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    hf = model.hf_text_config.to_dict()
    shapes = state_shapes_of(hf.get("model_type", ""), hf)
    itemsize = get_dtype_size(model.dtype)
    token_bytes = _attention_token_bytes(vllm_config)
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
    if cache.enable_prefix_caching:
        _check_prefix_match_unit(cache)
        cache.mamba_cache_mode = "align"
        cache.mamba_block_size = cache.block_size
    else:
        cache.mamba_cache_mode = "none"
        cache.mamba_block_size = model.max_model_len


def _attention_token_bytes(vllm_config: VllmConfig) -> int:
    """Bytes one token takes in an attention page: K and V rows in the model's dtype, one latent
    row for an MLA model, or the rows of a quantized cache as its spec declares them (`kv.quant`:
    the state pages themselves stay in the model's dtypes)."""
    from vllm.utils.torch_utils import get_dtype_size
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_metal.kv import quant, turboquant

    model = vllm_config.model_config
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    row_bytes = model.get_head_size() * get_dtype_size(model.dtype)
    if model.use_mla:  # one latent row per token and no values
        return heads * row_bytes
    cache_dtype = vllm_config.cache_config.cache_dtype
    if turboquant.requested(cache_dtype):
        # vLLM keeps no boundary layers at the model's dtype in a hybrid
        # (`TurboQuantConfig.get_boundary_skip_layers`): every attention page holds slots.
        return heads * turboquant.format_for(cache_dtype, model.get_head_size()).slot_bytes
    if not quant.requested(cache_dtype):
        return 2 * heads * row_bytes
    storage = quant.spec_storage(cache_dtype, model.get_head_size())
    spec = FullAttentionSpec(
        block_size=1, num_kv_heads=heads, head_size=model.get_head_size(), **storage
    )
    return spec.page_size_bytes


def _check_prefix_match_unit(cache: CacheConfig) -> None:
    """States are saved at block boundaries only, so hits land there: a finer prefix-match unit
    would need states inside a block."""
    unit = cache.prefix_match_unit
    if unit is not None and unit != cache.block_size:
        raise ValueError(
            f"vllm-metal: --prefix-match-unit {unit} is not served with a hybrid model: its state "
            f"layers save their state at block boundaries ({cache.block_size} tokens here); "
            f"leave it unset or set it to {cache.block_size}"
        )


_MAMBA_TYPES = {"gated_delta": "GDN_ATTN", "mamba2": "MAMBA2", "short_conv": "SHORT_CONV"}


def mamba_spec(shapes: StateShapes, dtype: Any, cache: CacheConfig):
    """vLLM's spec of one state layer (`dtype`: the torch cache dtype of the conv window), as
    `align_block_size` set the cache config up."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    # A short convolution's state is its window alone (vLLM's `short_conv_state_shape`).
    recurrent = ((shapes.recurrent, torch.float32),) if shapes.recurrent else ()
    return MambaSpec(
        shapes=(shapes.conv, *(shape for shape, _ in recurrent)),
        dtypes=(dtype, *(dt for _, dt in recurrent)),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum[_MAMBA_TYPES[shapes.mixer]],
        mamba_cache_mode=cache.mamba_cache_mode,
    )


@dataclass(frozen=True)
class StateBlocks:
    """The state pages of a step's requests, in one state group (module docstring)."""

    read: np.ndarray  # [S] block ids holding the state the step starts from
    write: np.ndarray  # [S] block ids that receive the state after the step's last token
    fresh: np.ndarray  # [S] bools: the request starts from a zero state (nothing computed)
    # Where pages are for other token counts (drafts committed after the step, `state_drafts`):
    table: np.ndarray  # [S, n] the group's block table rows
    computed: np.ndarray  # [S] tokens computed before the step
    block_size: int  # tokens per block of the group's table

    @classmethod
    def of_step(
        cls, table: np.ndarray, block_size: int, computed: np.ndarray, seq_lens: np.ndarray
    ) -> StateBlocks:
        """From the group's block table `[S, n]`, its block size, and each request's tokens
        computed before the step and after it."""
        # A request with nothing computed reads column 0 (its state is zeros anyway).
        start = page_column(np.maximum(computed, 1), block_size)
        rows = np.arange(len(seq_lens))
        return cls(
            table[rows, start], table[rows, page_column(seq_lens, block_size)], computed == 0,
            table, computed, block_size,
        )  # fmt: skip


@dataclass(frozen=True)
class TracedBlocks:
    """The state pages of a compiled decode step's rows (`runner/compiled.py`), inputs of its
    trace: read and written as `StateBlocks`' are, with nothing read on the host."""

    read: mx.array  # [rows] int32 block ids holding the state each row starts from
    write: mx.array  # [rows] int32 block ids that receive its state after the step
    keep: mx.array  # [rows] bool: False where the row starts from a zero state

    @classmethod
    def of_step(cls, blocks: StateBlocks, rows: int) -> TracedBlocks:
        """`blocks` of a step's requests, padded to `rows` rows that read and write block 0
        (vLLM's null block, which no request owns)."""
        read, write = np.zeros((2, rows), np.int32)
        keep = np.zeros(rows, bool)
        n = len(blocks.read)
        read[:n], write[:n], keep[:n] = blocks.read, blocks.write, ~blocks.fresh
        return cls(mx.array(read), mx.array(write), mx.array(keep))


def page_column(num_tokens: np.ndarray, block_size: int) -> np.ndarray:
    """The block-table column of the page holding the state after `num_tokens` tokens."""
    return (num_tokens - 1) // block_size


def state_layer(call: Callable[[Any, mx.array, StateLayerCache], mx.array]):
    """Route a family's packed state-layer function through `StateLayerCache.run` (a step
    verifying drafts runs it over expanded rows, `state_drafts`)."""

    @wraps(call)
    def run(layer: Any, x: mx.array, cache: StateLayerCache) -> mx.array:
        return cache.run(call, layer, x)

    return run


class StateLayerCache:
    """What one state layer sees during a step: its requests' state pages in the pool."""

    def __init__(
        self,
        pool: KVPool,
        region: int,
        shapes: StateShapes,
        blocks: StateBlocks | TracedBlocks,
        cu_seqlens: mx.array,
        drafts: StepDrafts | None = None,
        query_rows: int | None = None,
    ):
        self.pool = pool
        self.region = region
        self.shapes = shapes
        self.blocks = blocks
        self.cu_seqlens = cu_seqlens  # [S+1] int32
        # A traced step's rows per sequence (`StepMetadata.query_rows`), the recurrent ops'
        # `max_query_len`; None: an eager step.
        self.query_rows = query_rows
        # The step verifies drafts: the layer runs over expanded rows (`run`), and the states of
        # the verifying requests wait for the accepted drafts.
        self.drafts = drafts

    def run(self, call: Callable[[Any, mx.array, StateLayerCache], mx.array], layer, x):
        """`call(layer, x, cache)` over the step's rows (`x` `[T, 1, hidden]`)."""
        if self.drafts is None:
            return call(layer, x, self)
        return self.drafts.run(call, layer, x, self)

    # A page is handled in bytes (never converted, so any bit pattern survives), and
    # only the token rows of a block that hold state are read or written: the K rows first,
    # then as many V rows as the rest needs (the padding vLLM counts is left alone). K and V
    # rows may differ in width (a TurboQuant pool's key and value slots, `kv.turboquant`).

    def _words(self, array: mx.array) -> int:
        """Words per token row of a K or V array (its own dtype: bytes in a quantized pool)."""
        return int(np.prod(array.shape[2:])) * array.dtype.size // _WORD.size

    def _layout(self) -> tuple[int, int, int, int]:
        """Words per K token row, token rows holding state in K and in V, conv window words (a
        latent pool's page is its K rows alone: it has no V)."""
        keys = self.pool.keys[self.region]
        block_size = keys.shape[1]
        row_words = self._words(keys)
        conv_words = -(-int(np.prod(self.shapes.conv)) * self.pool.row_dtype.size // _WORD.size)
        used = self.shapes.recurrent_bytes() // _WORD.size + conv_words
        k_rows = min(-(-used // row_words), block_size)
        rest = used - k_rows * row_words
        if self.pool.latent and rest > 0:
            raise ValueError(f"a state page of {used} words does not fit a latent block")
        v_rows = 0 if rest <= 0 else -(-rest // self._words(self.pool.values[self.region]))
        return row_words, k_rows, v_rows, conv_words

    def read(self) -> tuple[mx.array, mx.array]:
        """Each request's convolution window `[S, K-1, C]` (cache dtype) and recurrent state
        (float32); zeros for fresh requests."""
        blocks = self.blocks
        traced = isinstance(blocks, TracedBlocks)
        idx = blocks.read if traced else mx.array(blocks.read.astype(np.int32))
        num = idx.shape[0]
        _, k_rows, v_rows, conv_words = self._layout()

        def words(pool: mx.array, rows: int) -> mx.array:
            return mx.view(pool[idx, :rows], _WORD).reshape(num, -1)

        page = words(self.pool.keys[self.region], k_rows)
        if v_rows:
            page = mx.concatenate([page, words(self.pool.values[self.region], v_rows)], axis=1)
        split = self.shapes.recurrent_bytes() // _WORD.size
        if self.shapes.recurrent:
            recurrent = mx.view(page[:, :split], RECURRENT_DTYPE)
            recurrent = recurrent.reshape(num, *self.shapes.recurrent)
        else:  # a short convolution: the window alone
            recurrent = mx.zeros((num, 0), dtype=RECURRENT_DTYPE)
        conv = mx.view(page[:, split : split + conv_words], self.pool.row_dtype)
        conv = conv[:, : int(np.prod(self.shapes.conv))].reshape(num, *self.shapes.conv)
        keep = None
        if traced:
            keep = blocks.keep
        elif blocks.fresh.any():
            keep = mx.array(~blocks.fresh)
        if keep is not None:
            if self.shapes.recurrent:
                recurrent = mx.where(keep[:, None, None, None], recurrent, 0)
            conv = mx.where(keep[:, None, None], conv, 0)
        return conv, recurrent

    def write(self, conv: mx.array, recurrent: mx.array) -> None:
        """Store each request's new window and state in its page (in place); on a step verifying
        drafts, the verifying requests' states wait for `StepDrafts.commit`."""
        if self.drafts is None:
            self.store(conv, recurrent, self.blocks.write)
        else:
            self.drafts.write(self, conv, recurrent)

    def store(self, conv: mx.array, recurrent: mx.array, blocks: np.ndarray | mx.array) -> None:
        """Store window `i` and state `i` in the page of block `blocks[i]` (in place); blocks
        on the device (a traced step's) are written with nothing read on the host."""
        num = blocks.shape[0]
        if num == 0:
            return
        traced = isinstance(blocks, mx.array)
        keys = self.pool.keys[self.region]
        values = None if self.pool.latent else self.pool.values[self.region]
        block_size = keys.shape[1]
        row_words, k_rows, _, conv_words = self._layout()
        conv = conv.astype(self.pool.row_dtype).reshape(num, -1)
        pad = conv_words * _WORD.size // self.pool.row_dtype.size - conv.shape[1]
        if pad:
            conv = mx.concatenate([conv, mx.zeros((num, pad), dtype=conv.dtype)], axis=1)
        parts = [mx.view(conv, _WORD)]
        if self.shapes.recurrent:
            parts.insert(0, mx.view(recurrent.astype(RECURRENT_DTYPE), _WORD).reshape(num, -1))
        # K and V take the same slots, so the V part is padded to the K rows (a latent pool
        # has no V part).
        half = k_rows * row_words
        whole = half + (0 if values is None else k_rows * self._words(values))
        used = sum(p.shape[1] for p in parts)
        parts.append(mx.zeros((num, whole - used), dtype=_WORD))
        page = mx.concatenate(parts, axis=1)

        def rows(part: mx.array, array: mx.array) -> mx.array:
            return mx.view(part, array.dtype).reshape(num * k_rows, *array.shape[2:])

        if traced:
            slots = (blocks.astype(mx.int64)[:, None] * block_size + mx.arange(k_rows)).reshape(-1)
        else:  # host data, which a write's host-side plan reads without waiting
            slots = blocks.astype(np.int64)[:, None] * block_size + np.arange(k_rows)
            slots = mx.array(slots.reshape(-1))
        if self.pool.latent:
            self.pool.keys[self.region] = ops.mla_reshape_and_cache(
                rows(page, keys), keys, slots, padded=not traced
            )
            return
        # A quantized pool's attention rows are bytes, and so is a page: it is copied as it is,
        # never quantized (`cache.batched` writes what it is given).
        float_rows = keys.dtype == values.dtype == self.pool.row_dtype
        write = ops.reshape_and_cache if float_rows else batched_write
        kc, vc = write(
            rows(page[:, :half], keys),
            rows(page[:, half:], values),
            keys,
            values,
            slots,
            padded=not traced,
        )
        self.pool.keys[self.region] = kc
        self.pool.values[self.region] = vc
