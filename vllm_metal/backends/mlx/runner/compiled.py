"""Decode steps through one `mx.compile`d function: the decoder's whole forward traced once per
shape bucket and replayed, so a step costs no Python per layer and MLX fuses its elementwise ops.

A step qualifies when every scheduled request decodes one token with no drafts and no extra
inputs but an EAGLE-3 head's aux states, which the trace returns beside the hidden states
(`takes`); prefill chunks, verification rows, media and the rest stay eager, as do models
whose layers keep more than paged K/V (`eager_reason`). The batch's rows and each block table's
columns are padded to the next size of 1, 2, 3, 4, 6, 8, 12, ... (`bucket`), so a server traces a
few dozen shapes and pads by at most a third.
Everything that changes between steps is an input of the compiled function (token ids, positions,
lengths, block tables, slots, and the pools themselves, whose updated arrays it returns); the
weights are constants of the trace, so a model reloaded (sleep level 2) gets a new `CompiledDecode`.
Padding rows decode token 0 at position 0 into slot 0 of block 0, vLLM's null block, which no
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
from vllm_metal.backends.mlx.runner.forward import attention_cache, step_token_ids
from vllm_metal.backends.mlx.runner.model_states.interface import NO_INPUTS
from vllm_metal.kv.paged_cache import GroupTables, StepMetadata
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

NULL_SLOT = 0  # slot 0 of block 0: vLLM's null block, which no request is given


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
    if any(kind.is_state or kind.latent for kind in kinds):
        return "layers that keep state or latent (MLA) rows"
    if vllm_config.lora_config is not None:
        return "LoRA adapters (a step's adapter mask is not an input of the trace)"
    return None


def bucket(n: int) -> int:
    """The padded size of a traced dimension of size `n`: the least power of two or 1.5 times a
    power of two at or above it (at least 1)."""
    power = 1 << max(0, int(n) - 1).bit_length()
    return power * 3 // 4 if power >= 4 and power * 3 // 4 >= n else power


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
        self._aranges: dict[int, mx.array] = {}
        self.steps = 0  # steps run compiled (tests read it)
        # Why tracing the forward failed (the model's decode steps then stay eager), or None.
        self.failed: str | None = None

    @staticmethod
    def takes(packed: PackedBatch, inputs: StepInputs) -> bool:
        """A decode step: one token per request, no drafts, nothing but the packed batch (and
        the aux layers an EAGLE-3 head reads)."""
        others = (getattr(inputs, f.name) for f in fields(inputs) if f.name != "aux")
        return (
            (inputs is NO_INPUTS or all(value is None for value in others))
            and packed.num_tokens == len(packed.req_ids)
            and not packed.num_draft_tokens.any()
        )

    def hidden_states(
        self, pool: KVPool, packed: PackedBatch, aux: AuxHidden | None = None
    ) -> mx.array | None:
        """The decoder's final hidden states of the step's tokens (`[S, 1, hidden]`), its K/V
        written into `pool`, and with `aux` the aux states of its layers (`aux.states`). Lazy,
        as the eager forward. None, with `failed` set and the pool untouched, when the forward
        cannot be traced (a family reading values on the host): the caller runs the step
        eagerly, as every later one."""
        num_seqs = packed.num_tokens
        rows = bucket(num_seqs)
        positions = _padded(packed.positions, rows, 0)
        seq_lens = _padded(packed.seq_lens, rows, 1)
        tables, slots = [], []
        for table, slot_mapping in zip(packed.block_tables, packed.slot_mappings):
            padded = np.zeros((rows, bucket(table.shape[1])), dtype=np.int32)
            padded[:num_seqs, : table.shape[1]] = table
            tables.append(mx.array(padded))
            slots.append(mx.array(_padded(np.maximum(slot_mapping, NULL_SLOT), rows, NULL_SLOT)))
        self._pool = pool
        forward = self._forward
        if aux is not None:
            assert self._aux_layer_ids in ((), aux.layer_ids), "one set of aux layers per engine"
            self._aux_layer_ids, forward = aux.layer_ids, self._forward_aux
        try:
            out = forward(
                step_token_ids(packed, rows),
                mx.array(positions),
                mx.array(seq_lens),
                self._arange(rows + 1),
                tables,
                slots,
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
        if aux is not None:
            aux.states = aux_states[0][:num_seqs]
        pool.keys[:], pool.values[:] = keys, values
        self.steps += 1
        return hidden[:num_seqs]

    def _trace(self, token_ids, positions, seq_lens, cu_seqlens_q, tables, slots, keys, values):
        pool, caches = self._caches(positions, seq_lens, cu_seqlens_q, tables, slots, keys, values)
        ids = token_ids[:, None]
        extra = {"token_ids": ids} if self.adapter.takes_token_ids else {}
        hidden = self.adapter.forward(self.adapter.embed(ids), caches, **extra)
        return hidden, pool.keys, pool.values

    def _trace_aux(self, token_ids, positions, seq_lens, cu_seqlens_q, tables, slots, keys, values):
        pool, caches = self._caches(positions, seq_lens, cu_seqlens_q, tables, slots, keys, values)
        embeds = self.adapter.embed(token_ids[:, None])
        hidden, aux = self.adapter.forward_with_aux(embeds, caches, self._aux_layer_ids)
        return hidden, aux, pool.keys, pool.values

    def _caches(self, positions, seq_lens, cu_seqlens_q, tables, slots, keys, values):
        """The traced pool over `keys` / `values` and each layer's paged view of the step."""
        assert self._pool is not None, "traced outside hidden_states"
        pool = self._pool.over(keys, values)
        groups = [GroupTables(t, s) for t, s in zip(tables, slots)]
        meta = StepMetadata(positions, seq_lens, cu_seqlens_q, groups, decode=True)
        return pool, [
            attention_cache(pool, i, kind, meta, False) for i, kind in enumerate(self.kinds)
        ]

    def _arange(self, n: int) -> mx.array:
        """`cu_seqlens_q` of `n - 1` one-token rows, made from host data once per size."""
        if n not in self._aranges:
            self._aranges[n] = mx.array(np.arange(n, dtype=np.int32))
        return self._aranges[n]


def _padded(values: np.ndarray, rows: int, fill: int) -> np.ndarray:
    out = np.full(rows, fill, dtype=values.dtype)
    out[: len(values)] = values
    return out
