"""Drafts from a DFlash head (`--speculative-config '{"method": "dflash", "model": ...}'`; the
head: `models/families/dflash.py`), as vLLM 0.32's `DFlashProposer` drafts: all k drafts of a
request from one forward of the head.

After each step the target's aux states at every position it computed and kept (the step keeps
them for every packed token: `StepState.aux_hidden`) become the head's context: `fc`,
`hidden_norm` and each layer's k/v projections give K/V written at those positions into the
head's own layers (`dflash.layers.N.self_attn`, declared to vLLM beside the target's, in the
target's full-attention group). A request that drafts then runs its query block: the token after
its last kept position and k mask tokens at the next k + 1 positions (vLLM reserves k + 1
lookahead slots for them), every layer writing the block's K/V and attending over the context and
the block (both ways within the block where the head is non-causal: the block's key end is its
last position). Draft i is the argmax at mask i. The block's K/V are overwritten by the next
step's context, which starts at the first position not verified.

The context is written every step, for requests that do not draft too: it is a projection, not a
pass over the head's layers, so nothing is left for later (an EAGLE-3 or MTP head's deferral,
`head.py`, has nothing to save here); it reads no token, so where nobody drafts after a step it
is written before the step's tokens reach the host (`keeps_up`). Every drafting request runs all
k masks, as vLLM's proposer does, and its drafts are cut to its cap afterwards: with a
non-causal head the number of masks changes every draft; a request whose block would reach past
`max_model_len` (within k + 1 tokens of it) does not draft.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch, _tables_and_slots, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.backends.mlx.runner.spec_decode.drafter import (
    HeadWeights,
    PagedDrafter,
    block_tables,
    sampled_counts,
)
from vllm_metal.backends.mlx.runner.spec_decode.head import new_positions
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models.families import dflash
from vllm_metal.models.layers import FULL_ATTENTION

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState
    from vllm_metal.kv.pool import KVPool
    from vllm_metal.models import LayerKind
    from vllm_metal.models.families.dflash import DFlashHead

# Prefix of the head's layer names in vLLM's KV-cache config.
DFLASH_LAYER_PREFIX = "dflash."


def query_block(
    req_ids: list[str],
    last: np.ndarray,
    bonus: np.ndarray,
    num_masks: int,
    mask_id: int,
    tables: list[np.ndarray],
    block_sizes: list[int],
) -> PackedBatch:
    """The query rows of drafting requests (`tables`: their block table rows): per request the
    token after its last kept position `last` (`bonus`), then `num_masks` mask tokens, at
    positions last + 1 .. last + 1 + num_masks."""
    n, width = len(req_ids), num_masks + 1
    rows = np.repeat(np.arange(n, dtype=np.int32), width)
    offsets = np.tile(np.arange(width, dtype=np.int32), n)
    positions = (last.astype(np.int32)[rows] + 1 + offsets).astype(np.int32)
    tokens = np.where(offsets == 0, bonus.astype(np.int32)[rows], mask_id).astype(np.int32)
    seq_lens = (last + 1 + width).astype(np.int32)
    group_tables, slots = _tables_and_slots(tables, block_sizes, rows, positions, seq_lens)
    cu = np.arange(n + 1, dtype=np.int32) * width
    return PackedBatch(
        req_ids=list(req_ids),
        num_scheduled=np.full(n, width, dtype=np.int32),
        cu_seqlens_q=cu,
        token_ids=tokens,
        positions=positions,
        seq_lens=seq_lens,
        block_tables=group_tables,
        slot_mappings=slots,
        logits_indices=np.zeros(0, dtype=np.int32),
        discard=np.zeros(n, dtype=bool),
        num_draft_tokens=np.zeros(n, dtype=np.int32),
    )


class DFlashDrafter(HeadWeights, PagedDrafter):
    def __init__(self, vllm_config: VllmConfig, target: ModelState, *, kv_dtype: mx.Dtype):
        spec = vllm_config.speculative_config
        self.draft_config = spec.draft_model_config
        super().__init__(
            self.draft_config.get_num_kv_heads(spec.draft_parallel_config),
            self.draft_config.get_head_size(),
            kv_dtype,
            draft_cache_config(vllm_config),
        )
        self.target = target
        self.download_dir = vllm_config.load_config.download_dir
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        self.num_masks = int(spec.num_speculative_tokens)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.draft = self.draft_config.hf_config.to_dict()
        self.aux_layer_ids = dflash.aux_layer_ids(self.draft)

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        path = resolve_model_path(
            self.draft_config.model, self.draft_config.revision, self.download_dir
        )
        self.head = dflash.load_head(
            self.draft, self.target_vocab_size, Path(path), self.target.compute_dtype
        )
        self.kinds = [FULL_ATTENTION] * len(self.head.layers)
        self.layer_names = [
            f"{DFLASH_LAYER_PREFIX}layers.{i}.self_attn" for i in range(len(self.head.layers))
        ]

    # ------------------------------------------------------------ drafting

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.head is not None and self.pool is not None, "the drafter's head is not ready"
        batch = states.input_batch
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        drafts: list[list[int]] = [[] for _ in range(n)]
        start, count = new_positions(step, states, sampled_counts(sampled))
        rows = np.nonzero(count > 0)[0]
        if rows.size == 0:
            return drafts
        tables = block_tables(states, len(step.packed.block_tables))
        self._write_context(step, states, tables, rows, start, count)
        # A block reaching past max_model_len has no blocks to write (vLLM's lookahead stops
        # there): such a request, within k + 1 tokens of its end, stops drafting.
        fits = start[rows] + count[rows] + self.num_masks < self.max_model_len
        drafting = rows[(caps[rows] > 0) & fits]
        if drafting.size == 0:
            # Queued, not waited for: the next step's reads of the head's K/V come after
            # these writes in MLX's graph.
            mx.async_eval(*self.pool.arrays())
            return drafts
        last = start[drafting] + count[drafting] - 1
        bonus = batch.token_ids_cpu[drafting, last + 1]
        tokens = self._draft_block(
            [req_ids[r] for r in drafting], last, bonus, [t[drafting] for t in tables], states
        )
        for r, row in zip(drafting, np.array(tokens).tolist()):
            drafts[r] = [int(t) for t in row[: int(caps[r])]]
        return drafts

    def keeps_up(self, step: StepState, states: RequestStates, num_sampled: np.ndarray) -> bool:
        """Where nobody drafts after `step`: the context of its new positions, written before
        its tokens reach the host (the context reads no token)."""
        assert self.head is not None and self.pool is not None, "the drafter's head is not ready"
        start, count = new_positions(step, states, num_sampled, unrecorded=num_sampled)
        rows = np.nonzero(count > 0)[0]
        if rows.size:
            tables = block_tables(states, len(step.packed.block_tables))
            self._write_context(step, states, tables, rows, start, count)
            mx.async_eval(*self.pool.arrays())
        return True

    def _write_context(
        self,
        step: StepState,
        states: RequestStates,
        tables: list[np.ndarray],
        rows: np.ndarray,
        start: np.ndarray,
        count: np.ndarray,
    ) -> None:
        """The context K/V of each row's new positions (`rows` of the batch and of the step
        alike), from the target's aux states at them."""
        assert step.aux_hidden is not None, "the step kept no aux hidden states"
        batch = states.input_batch
        offsets = step.packed.cu_seqlens_q[rows]
        gather = np.concatenate([o + np.arange(c) for o, c in zip(offsets, count[rows])])
        aux = step.aux_hidden[mx.array(gather.astype(np.int32))]
        ids = [batch.req_ids[r] for r in rows]
        packed = pack_batch(
            ids,
            dict(zip(ids, count[rows].tolist())),
            start[rows],
            start[rows] + count[rows],
            batch.token_ids_cpu[rows],
            [t[rows] for t in tables],
            states.block_sizes,
        )
        self.head.write_context(aux, layer_caches(self.pool, packed, self.kinds))

    def _draft_block(
        self,
        req_ids: list[str],
        last: np.ndarray,
        bonus: np.ndarray,
        tables: list[np.ndarray],
        states: RequestStates,
    ) -> mx.array:
        """The head's k drafts `[n, k]` (target token ids) of requests whose last kept
        positions are `last` and whose next tokens are `bonus`."""
        block = query_block(
            req_ids, last, bonus, self.num_masks, self.head.mask_token_id, tables,
            states.block_sizes,
        )  # fmt: skip
        adapter = self.target.adapter
        _, tokens = block_drafts(self.head, self.pool, self.kinds, block, adapter.embed,
                                 adapter.logits)  # fmt: skip
        mx.eval(tokens, *self.pool.arrays())
        return tokens


def block_drafts(
    head: DFlashHead,
    pool: KVPool,
    kinds: list[LayerKind],
    block: PackedBatch,
    target_embed: Callable[[mx.array], mx.array],
    target_logits: Callable[[mx.array], mx.array],
) -> tuple[mx.array, mx.array]:
    """The head over query blocks (`query_block`), writing their K/V into `pool`: the logits
    at the masks `[n * k, Vd]` and the drafts `[n, k]` (target token ids). Lazy."""
    width = int(block.num_scheduled[0])
    n = len(block.req_ids)
    # Non-causal: every row of a block reaches the block's last position.
    key_ends = None if head.causal else np.repeat(block.seq_lens, width).astype(np.int32)
    caches = layer_caches(pool, block, kinds, key_ends)
    out = head(head.embed(mx.array(block.token_ids)[:, None], target_embed), caches)
    at_masks = np.nonzero(np.arange(n * width) % width != 0)[0].astype(np.int32)
    out = out[mx.array(at_masks)]
    logits = head.lm_head(out) if head.lm_head is not None else target_logits(out)
    logits = logits.reshape(out.shape[0], -1)
    return logits, head.draft_tokens(logits).reshape(n, width - 1)
