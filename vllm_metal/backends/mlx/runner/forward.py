"""One packed forward: the step's varlen metadata on the device; a cache view per layer (paged
K/V for attention, latent rows for MLA, its requests' state pages for a hybrid model's state
layers); the adapter's embeddings -> decoder (`hidden_states`, what pooling heads read) -> head on
the rows that need logits (`forward`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch
from vllm_metal.backends.mlx.runner.mm.embeddings import merge
from vllm_metal.backends.mlx.runner.model_states.interface import NO_INPUTS, StepInputs
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.kv.paged_cache import GroupTables, PagedLayerCache, StepMetadata
from vllm_metal.kv.pool import KVPool
from vllm_metal.kv.state import StateBlocks, StateLayerCache, TracedBlocks
from vllm_metal.kv.state_drafts import StepDrafts
from vllm_metal.kv.turboquant import TurboQuantPool
from vllm_metal.kv.turboquant import layer_cache as turboquant_layer_cache
from vllm_metal.models import ModelAdapter
from vllm_metal.models.layers import LayerKind
from vllm_metal.models.multimodal import MultimodalAdapter

NULL_SLOT = 0  # slot 0 of block 0: vLLM's null block, which no request is given


def slots_at(table: mx.array, block_size: int, positions: mx.array, real: mx.array) -> mx.array:
    """On the device: each row's slot at its position in its block table's row (block id *
    block size + offset, as `batch.pack_batch` makes them), `NULL_SLOT` where `real` is false."""
    block = mx.take_along_axis(table, (positions // block_size)[:, None], axis=1)[:, 0]
    slot = block.astype(mx.int64) * block_size + (positions % block_size).astype(mx.int64)
    return mx.where(real, slot, NULL_SLOT)


def step_token_ids(packed: PackedBatch, dest: np.ndarray | None = None, size: int = 0) -> mx.array:
    """The step's token ids on the device (`[T]` int32), with the tokens a pending step drew on
    the device in their places (`PackedBatch.carried`); with `dest`, token i at `dest[i]` among
    `size` zeros (a compiled step's padded layout)."""
    ids = packed.token_ids
    if dest is not None:
        ids = np.zeros(size, dtype=np.int32)
        ids[dest] = packed.token_ids
    out = mx.array(ids)
    if packed.carried is not None:
        index, tokens = packed.carried
        out[mx.array(index if dest is None else dest[index])] = tokens.astype(out.dtype)
    return out


def step_metadata(
    packed: PackedBatch,
    key_ends: np.ndarray | None = None,
    block_sizes: Sequence[int] = (),
) -> StepMetadata:
    """The step's varlen metadata, moved to the device; where its rows' positions are shifted
    on the device (`PackedBatch.shift`), its positions, lengths and slots (from the block
    tables, of `block_sizes`) are those."""
    positions, seq_lens = mx.array(packed.positions), mx.array(packed.seq_lens)
    tables = [mx.array(t) for t in packed.block_tables]
    slots = [mx.array(s) for s in packed.slot_mappings]
    if packed.shift is not None:
        row_of_token = mx.array(np.repeat(np.arange(len(packed.req_ids)), packed.num_scheduled))
        positions, seq_lens = positions - packed.shift[row_of_token], seq_lens - packed.shift
        real = mx.ones(positions.shape, dtype=mx.bool_)
        slots = [
            slots_at(table[row_of_token], size, positions, real)
            for table, size in zip(tables, block_sizes, strict=True)
        ]
    return StepMetadata(
        positions=positions,
        seq_lens=seq_lens,
        cu_seqlens_q=mx.array(packed.cu_seqlens_q),
        groups=[
            GroupTables(block_tables=t, slot_mapping=s) for t, s in zip(tables, slots, strict=True)
        ],
        key_ends=key_ends,
    )


def layer_caches(
    pool: KVPool,
    packed: PackedBatch,
    kinds: Sequence[LayerKind],
    key_ends: np.ndarray | None = None,
    drafts: StepDrafts | None = None,
    key_ends_sliding_only: bool = False,
) -> list[PagedLayerCache | LatentLayerCache | StateLayerCache]:
    """One cache view per layer of `kinds`; `key_ends` (media attended both ways) apply to every
    attention layer, or with `key_ends_sliding_only` to the sliding-window ones."""
    block_sizes = pool.layout.block_sizes()
    meta = step_metadata(packed, key_ends, block_sizes)
    computed = packed.seq_lens - packed.num_scheduled
    state_blocks = {
        group: StateBlocks.of_step(
            packed.block_tables[group], block_sizes[group], computed, packed.seq_lens
        )
        for group in state_groups(pool, kinds)
    }
    return [
        layer_cache(pool, i, kind, meta, state_blocks, drafts, key_ends_sliding_only)
        for i, kind in enumerate(kinds)
    ]


def state_groups(pool: KVPool, kinds: Sequence[LayerKind]) -> list[int]:
    """The KV-cache groups of the state layers among `kinds`, in order."""
    group = pool.layout.group_of_layer
    return sorted({group[i] for i, kind in enumerate(kinds) if kind.is_state})


def layer_cache(
    pool: KVPool,
    layer: int,
    kind: LayerKind,
    meta: StepMetadata,
    state_blocks: Mapping[int, StateBlocks | TracedBlocks],
    drafts: StepDrafts | None = None,
    key_ends_sliding_only: bool = False,
) -> PagedLayerCache | LatentLayerCache | StateLayerCache:
    """The view of layer `layer` for the step of `meta` (eager, or traced when it says
    `query_rows`): paged K/V, latent rows, or its state group's pages (`state_blocks`)."""
    region, group = pool.layout.region_of_layer[layer], pool.layout.group_of_layer[layer]
    if kind.is_state:
        return StateLayerCache(
            pool, region, kind.state, state_blocks[group], meta.cu_seqlens_q, drafts,
            query_rows=meta.query_rows,
        )  # fmt: skip
    if kind.latent:
        return LatentLayerCache(pool, region, meta, meta.groups[group])
    return attention_cache(pool, layer, kind, meta, key_ends_sliding_only)


def attention_cache(
    pool: KVPool, layer: int, kind: LayerKind, meta: StepMetadata, key_ends_sliding_only: bool
) -> PagedLayerCache:
    """The paged view of attention layer `layer` (of kind `kind`) for the step of `meta`."""
    bidirectional = not key_ends_sliding_only or kind.sliding_window is not None
    if isinstance(pool, TurboQuantPool):
        return turboquant_layer_cache(pool, layer, kind, meta, bidirectional)
    layout = pool.layout
    group = layout.group_of_layer[layer]
    return PagedLayerCache(
        pool,
        layout.region_of_layer[layer],
        meta,
        meta.groups[group],
        kind.sliding_window,
        page_shape=(
            layout.block_sizes()[group],
            *pool.stored_shape(*kind.kv_shape(*pool.kv_shape)),
        ),
        writes=kind.kv_source is None,
        bidirectional=bidirectional,
        quant=None if pool.layer_quant is None else pool.layer_quant[layer],
    )


def hidden_states(
    adapter: ModelAdapter,
    pool: KVPool,
    kinds: Sequence[LayerKind],
    packed: PackedBatch,
    inputs: StepInputs = NO_INPUTS,
) -> mx.array:
    """The decoder's final hidden states of every packed token (`[T, 1, hidden]`), writing the
    step's K/V into the pool. From `inputs`: `mm_rows` (encoder outputs of images) replace the
    embeddings of their placeholder tokens; an M-RoPE model takes `mrope_positions` (without
    them every token is text, at its index on all three streams); a prefix-LM model the
    `key_ends` of its image tokens (`mm.spans`); with `aux`, the aux states an EAGLE-3 head reads are
    kept there. Lazy."""
    sliding_only = getattr(adapter, "bidirectional_sliding_only", False)
    caches = layer_caches(pool, packed, kinds, inputs.key_ends, inputs.drafts, sliding_only)
    token_ids = step_token_ids(packed)[:, None]  # [T, 1]
    if adapter.stage is not None:  # a pipeline stage: its layers, from tokens or hidden states
        stage_in = adapter.embed(token_ids) if inputs.stage_hidden is None else inputs.stage_hidden
        return adapter.forward_stage(stage_in, caches)
    embeds = merge(adapter.embed(token_ids), inputs.mm_rows)  # [T, 1, hidden]
    extra = {"token_ids": token_ids} if adapter.takes_token_ids else {}
    if inputs.aux is not None:  # an EAGLE-3 drafter's target (`families.eagle3.TARGET_TYPES`)
        hidden, inputs.aux.states = adapter.forward_with_aux(embeds, caches, inputs.aux.layer_ids)
        return hidden
    if not isinstance(adapter, MultimodalAdapter):
        return adapter.forward(embeds, caches, **extra)
    mrope_positions = inputs.mrope_positions
    if adapter.uses_mrope and mrope_positions is None:
        mrope_positions = np.broadcast_to(packed.positions, (3, packed.num_tokens))
    positions = None if mrope_positions is None else mx.array(mrope_positions)[:, :, None]
    return adapter.forward(embeds, caches, positions=positions, rows=inputs.mm_rows, **extra)


def forward(
    adapter: ModelAdapter,
    pool: KVPool,
    kinds: Sequence[LayerKind],
    packed: PackedBatch,
    prompt_rows: Mapping[str, np.ndarray],
    inputs: StepInputs = NO_INPUTS,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Float32 logits of the rows in `packed.logits_indices` (`[S + drafts, V]`), and of the
    rows asked for prompt logprobs (req_id -> `[n, V]`). Lazy: nothing is evaluated here."""
    hidden = hidden_states(adapter, pool, kinds, packed, inputs)
    return logits_of(adapter, hidden, packed, prompt_rows)


def logits_of(
    adapter: ModelAdapter,
    hidden: mx.array,
    packed: PackedBatch,
    prompt_rows: Mapping[str, np.ndarray],
) -> tuple[mx.array, dict[str, mx.array]]:
    """`forward`'s result from the hidden states of every packed token (`[T, ...]`)."""
    rows = [packed.logits_indices]
    spans: list[tuple[str, int, int]] = []
    offset = len(packed.logits_indices)
    for req_id, r in prompt_rows.items():
        rows.append(r)
        spans.append((req_id, offset, offset + len(r)))
        offset += len(r)
    indices = np.concatenate(rows).astype(np.int32)
    if indices.size == 0:  # nothing needs logits (a draft model's cache-filling pass)
        return mx.zeros((0, 0), dtype=mx.float32), {}
    selected = hidden[mx.array(indices)]
    logits = adapter.logits(selected)
    logits = logits.reshape(logits.shape[0], -1).astype(mx.float32)
    num_rows = len(packed.logits_indices)
    return logits[:num_rows], {req_id: logits[a:b] for req_id, a, b in spans}
