"""Decode and verification steps through one `mx.compile`d function: the decoder's whole forward
traced once per shape bucket and replayed, so a step costs no Python per layer and MLX fuses its
elementwise ops.

A step qualifies when every scheduled request feeds its last token and its drafts to verify, if
any, and no extra inputs but an EAGLE-3 head's aux states, which the trace returns beside the
hidden states (`takes`); prefill chunks, media and the rest stay eager (`eager_reason`, `takes`);
an MLA model's latent cache is traced as paged K/V is, and a hybrid's state pages by block ids
that are inputs of the trace (its steps verifying drafts stay eager: their states wait for the
verdicts, `kv.state_drafts`).
Every request gets the same number of query rows, the most drafts of the step plus one: a request
with fewer drafts is padded at its end by tokens that continue its positions, write nowhere
(`NULL_SLOT`) and whose outputs are dropped; causal attention keeps them out of the request's own
rows. The batch's rows and each block table's columns are padded to the next size of 1, 2, 3, 4,
6, 8, 12, ... (`bucket`), so a server traces a few dozen shapes and pads by at most a third.
Everything that changes between steps is an input of the compiled function (token ids, positions,
lengths, block tables, slots, and the pools themselves, whose updated arrays it returns); the
weights are constants of the trace, so a model reloaded (sleep level 2) gets a new `CompiledDecode`.
Padding rows decode tokens 0 from position 0 into slot 0 of block 0, vLLM's null block, which no
request owns and every read of it masks; their hidden states are dropped.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.device import device_kind
from vllm_metal.backends.mlx.runner.batch import ranges
from vllm_metal.backends.mlx.runner.forward import (
    NULL_SLOT,
    layer_cache,
    slots_at,
    state_groups,
    step_token_ids,
)
from vllm_metal.backends.mlx.runner.model_states.interface import NO_INPUTS
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata
from vllm_metal.kv.state import StateBlocks, TracedBlocks
from vllm_metal.kv.turboquant import TurboQuantPool
from vllm_metal.models.multimodal import MultimodalAdapter

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.model_states.interface import AuxHidden, StepInputs
    from vllm_metal.kv.pool import KVPool
    from vllm_metal.models import ModelAdapter
    from vllm_metal.models.layers import LayerKind

logger = init_logger(__name__)


def enabled(vllm_config: VllmConfig) -> bool:
    """Whether decode steps compile here: VLLM_METAL_COMPILE, whose `auto` compiles on MLX's GPU
    (Metal, or CUDA as the GPU proxy), where a step's host cost shows; on MLX's CPU the step's
    own compute hides it, and fusing buys less than the first traces cost."""
    wanted = envs.VLLM_METAL_COMPILE
    if wanted == "auto":
        return device_kind() == "gpu"
    return wanted == "1"


def eager_reason(
    adapter: ModelAdapter, kinds: Sequence[LayerKind], vllm_config: VllmConfig
) -> str | None:
    """Why this model's decode steps stay eager, or None when they compile."""
    if adapter.stage is not None:
        return "a pipeline stage"
    if isinstance(adapter, MultimodalAdapter):
        return "a model with media inputs"
    if vllm_config.lora_config is not None:
        return "LoRA adapters (a step's adapter mask is not an input of the trace)"
    return None


def bucket(n: int) -> int:
    """The padded size of a traced dimension of size `n`: the least power of two or 1.5 times a
    power of two at or above it (at least 1)."""
    power = 1 << max(0, int(n) - 1).bit_length()
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


def padded_table(table: np.ndarray, rows: int, longest: int, block_size: int) -> mx.array:
    """A block table (a row per request) padded with block 0, vLLM's null block, to `rows` rows
    and to the bucket of the columns `longest` tokens need (at least its own width)."""
    need = max(table.shape[1], -(-longest // block_size))
    padded = np.zeros((rows, bucket(need)), dtype=np.int32)
    padded[: table.shape[0], : table.shape[1]] = table
    return mx.array(padded)


class CompiledDecode:
    """The compiled decode forward of one loaded model (`hidden_states` of a qualifying step)."""

    def __init__(self, adapter: ModelAdapter, kinds: Sequence[LayerKind]):
        self.adapter = adapter
        self.kinds = list(kinds)
        self._pool: KVPool | None = None  # read while tracing only
        self._forward = mx.compile(self._trace)
        # With an EAGLE-3 drafter: its aux layers (one set per engine) and their trace.
        self._aux_layer_ids: tuple[int, ...] = ()
        self._forward_aux = mx.compile(self._trace_aux)
        self._cu: dict[tuple[int, int], mx.array] = {}
        self.steps = 0  # steps run compiled (tests read it)
        # Step shapes met so far (rows, query width, block-table widths, with aux or not), and
        # how many: a step of a new one traces the forward and builds its kernels, so its time
        # says little of the next ones'.
        self._shapes: set[tuple] = set()
        self.traces = 0
        self.verify_steps = 0  # of which verifying drafts
        # Why tracing the forward failed (the model's decode steps then stay eager), or None.
        self.failed: str | None = None

    def takes(self, pool: KVPool, packed: PackedBatch, inputs: StepInputs) -> bool:
        """A step of decode and verification rows: every request its last token and its drafts,
        nothing but the packed batch (and the aux layers an EAGLE-3 head reads). Over a
        TurboQuant pool decode steps only (a verifying step reads its fresh rows on the host)."""
        others = (getattr(inputs, f.name) for f in fields(inputs) if f.name != "aux")
        if not (inputs is NO_INPUTS or all(value is None for value in others)):
            return False
        if not packed.decodes_only:
            return False
        return not packed.num_draft_tokens.any() or not isinstance(pool, TurboQuantPool)

    def hidden_states(
        self, pool: KVPool, packed: PackedBatch, aux: AuxHidden | None = None
    ) -> mx.array | None:
        """The decoder's final hidden states of the step's tokens (`[T, 1, hidden]`), its K/V
        written into `pool`, and with `aux` the aux states of its layers (`aux.states`). Lazy,
        as the eager forward. None, with `failed` set and the pool untouched, when the forward
        cannot be traced (a family reading values on the host): the caller runs the step
        eagerly, as every later one."""
        num_seqs, num_tokens = len(packed.req_ids), packed.num_tokens
        rows, width = bucket(num_seqs), int(packed.num_scheduled.max(initial=1))
        # Where each of the step's tokens sits among the padded [rows * width].
        dest = np.repeat(np.arange(num_seqs) * width, packed.num_scheduled)
        dest += ranges(packed.num_scheduled)
        first = packed.positions[packed.cu_seqlens_q[:-1]]  # each request's first position
        positions = np.tile(np.arange(width, dtype=np.int32), rows)
        positions[: num_seqs * width] += np.repeat(first, width)
        seq_lens = np.full(rows, width, dtype=np.int32)
        seq_lens[:num_seqs] = first + width
        block_sizes = pool.layout.block_sizes()
        tables = [
            padded_table(table, rows, int(seq_lens.max()), size)
            for table, size in zip(packed.block_tables, block_sizes)
        ]
        positions, seq_lens = mx.array(positions), mx.array(seq_lens)
        if packed.shift is None:
            slots = []
            for slot_mapping in packed.slot_mappings:
                slot = np.full(rows * width, NULL_SLOT, dtype=np.int64)
                slot[dest] = np.maximum(slot_mapping, NULL_SLOT)
                slots.append(mx.array(slot))
        else:  # the rows' rejected drafts, known on the device only
            shift = mx.concatenate([packed.shift, mx.zeros(rows - num_seqs, dtype=mx.int32)])
            positions, seq_lens = positions - mx.repeat(shift, width), seq_lens - shift
            real = np.zeros(rows * width, dtype=bool)
            real[dest] = True
            slots = [
                slots_at(mx.repeat(table, width, axis=0), size, positions, mx.array(real))
                for table, size in zip(tables, block_sizes)
            ]
        states = [[b.read, b.write, b.keep] for b in self._state_blocks(pool, packed, rows)]
        assert packed.shift is None or not states, "a state's pages follow the host's lengths"
        shape = (aux is not None, rows, width, *(t.shape[1] for t in tables))
        if shape not in self._shapes:
            self._shapes.add(shape)
            self.traces += 1
        self._pool = pool
        forward = self._forward
        if aux is not None:
            assert self._aux_layer_ids in ((), aux.layer_ids), "one set of aux layers per engine"
            self._aux_layer_ids, forward = aux.layer_ids, self._forward_aux
        try:
            out = forward(
                step_token_ids(packed, dest, rows * width),
                positions,
                seq_lens,
                self._cu_seqlens(rows, width),
                tables,
                slots,
                states,
                pool.keys,
                pool.values,
            )
        except (ValueError, RuntimeError, TypeError, IndexError, AttributeError) as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            logger.warning("Decode steps stay eager: tracing the forward failed (%s)", self.failed)
            return None
        finally:
            self._pool = None
        hidden, *aux_states, keys, values = out
        pool.keys[:], pool.values[:] = keys, values
        self.steps += 1
        self.verify_steps += width > 1
        kept = (lambda a: a[:num_tokens]) if width == 1 else (lambda a: a[mx.array(dest)])
        if aux is not None:
            aux.states = kept(aux_states[0])
        return kept(hidden)

    def _state_blocks(self, pool: KVPool, packed: PackedBatch, rows: int) -> list[TracedBlocks]:
        """Each state group's pages of the step's rows (`kv.state`), padded to `rows`."""
        computed = packed.seq_lens - packed.num_scheduled
        block_sizes = pool.layout.block_sizes()
        return [
            TracedBlocks.of_step(
                StateBlocks.of_step(
                    packed.block_tables[g], block_sizes[g], computed, packed.seq_lens
                ),
                rows,
            )
            for g in state_groups(pool, self.kinds)
        ]

    def _trace(
        self, token_ids, positions, seq_lens, cu_seqlens_q, tables, slots, states, keys, values
    ):
        pool, caches = self._caches(
            positions, seq_lens, cu_seqlens_q, tables, slots, states, keys, values
        )
        ids = token_ids[:, None]
        extra = {"token_ids": ids} if self.adapter.takes_token_ids else {}
        hidden = self.adapter.forward(self.adapter.embed(ids), caches, **extra)
        return hidden, pool.keys, pool.values

    def _trace_aux(
        self, token_ids, positions, seq_lens, cu_seqlens_q, tables, slots, states, keys, values
    ):
        pool, caches = self._caches(
            positions, seq_lens, cu_seqlens_q, tables, slots, states, keys, values
        )
        embeds = self.adapter.embed(token_ids[:, None])
        hidden, aux = self.adapter.forward_with_aux(embeds, caches, self._aux_layer_ids)
        return hidden, aux, pool.keys, pool.values

    def _caches(self, positions, seq_lens, cu_seqlens_q, tables, slots, states, keys, values):
        """The traced pool over `keys` / `values` and each layer's view of the step: paged K/V,
        latent rows, or its state group's pages (`states`: each group's `TracedBlocks` arrays,
        in `state_groups`' order)."""
        assert self._pool is not None, "traced outside hidden_states"
        pool = self._pool.over(keys, values)
        groups = [GroupTables(t, s) for t, s in zip(tables, slots)]
        query_rows = positions.shape[0] // (cu_seqlens_q.shape[0] - 1)  # a shape: fixed per trace
        meta = StepMetadata(positions, seq_lens, cu_seqlens_q, groups, query_rows=query_rows)
        state_of = {g: TracedBlocks(*a) for g, a in zip(state_groups(pool, self.kinds), states)}
        return pool, [
            layer_cache(pool, i, kind, meta, state_of) for i, kind in enumerate(self.kinds)
        ]

    def _cu_seqlens(self, rows: int, width: int) -> mx.array:
        """`cu_seqlens_q` of `rows` rows of `width` tokens, made from host data once per size."""
        if (rows, width) not in self._cu:
            self._cu[rows, width] = mx.array(np.arange(rows + 1, dtype=np.int32) * width)
        return self._cu[rows, width]
