"""Drafts from an EAGLE-3 head (`--speculative-config '{"method": "eagle3", "model": ...}'`; the
head: `models/families/eagle3.py`).

The head reads the target's hidden states at a few layers (the step keeps them for every packed
token: `StepState.aux_hidden`), so it runs as the target's own MTP head does (`mtp.py`): after
every step over each scheduled request's new positions whose next token is known, position p fed
the token at p + 1 and `fc` of the target's aux states at p, each layer writing its K/V into its
own layer (`eagle3.layers.N.self_attn`, declared to vLLM beside the target's, in the target's
full-attention group), so the head's cache covers every request's sequence. A drafting request's
first draft is the argmax of the head's output at its last position; draft j + 1 comes from the
head at the next position fed draft j and the head's own pre-norm output before it, as vLLM's
EAGLE proposer chains them. Draft-vocabulary argmaxes map to target tokens through `d2t`. What
the head writes at draft positions is overwritten by the next step's pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch, decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.backends.mlx.runner.spec_decode.drafter import PagedDrafter, block_tables
from vllm_metal.backends.mlx.runner.spec_decode.mtp import new_positions
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models.families import eagle3
from vllm_metal.models.layers import FULL_ATTENTION

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState

# Prefix of the head's layer names in vLLM's KV-cache config.
EAGLE3_LAYER_PREFIX = "eagle3."


class Eagle3Drafter(PagedDrafter):
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
        self.num_target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        self.draft = self.draft_config.hf_config.to_dict()
        self.architecture = self.draft_config.architectures[0]
        self.aux_layer_ids = eagle3.aux_layer_ids(self.draft, self.num_target_layers)
        self.head: eagle3.Eagle3Head | None = None

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        path = resolve_model_path(
            self.draft_config.model, self.draft_config.revision, self.download_dir
        )
        self.head = eagle3.load_head(
            self.architecture,
            self.draft,
            self.num_target_layers,
            self.target_vocab_size,
            Path(path),
            self.target.compute_dtype,
        )
        self.kinds = [FULL_ATTENTION] * len(self.head.layers)
        self.layer_names = [
            f"{EAGLE3_LAYER_PREFIX}layers.{i}.self_attn" for i in range(len(self.head.layers))
        ]

    @property
    def weight_bytes(self) -> int:
        if self.head is None:
            return 0
        from vllm_metal.models.loaders import parameter_bytes

        return parameter_bytes(self.head)

    def discard(self, tags: tuple[str, ...]) -> None:
        super().discard(tags)
        if "weights" in tags:
            self.head = None

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and self.head is None:
            self.load()
        super().wake_up(tags)

    # ------------------------------------------------------------ drafting

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.head is not None and self.pool is not None, "EAGLE-3 head not ready"
        assert step.aux_hidden is not None, "the step kept no aux hidden states"
        batch = states.input_batch
        packed = step.packed
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        tables = block_tables(states, len(packed.block_tables))
        drafts: list[list[int]] = [[] for _ in range(n)]

        start, count = new_positions(step, states, sampled)
        rows = np.nonzero(count > 0)[0]
        if rows.size == 0:
            return drafts
        ids = [req_ids[r] for r in rows]
        # Column p of the shifted table holds the token at p + 1: the head's input at p.
        first = pack_batch(
            ids,
            dict(zip(ids, count[rows].tolist())),
            start[rows],
            start[rows] + count[rows],
            batch.token_ids_cpu[rows, 1:],
            [t[rows] for t in tables],
            states.block_sizes,
        )
        # The target's aux states at those positions: the first `count` rows of each request.
        offsets = packed.cu_seqlens_q[rows]
        gather = np.concatenate([o + np.arange(c) for o, c in zip(offsets, count[rows])])
        aux = step.aux_hidden[mx.array(gather.astype(np.int32))]
        normed, hidden = self._run(first, self.head.combine(aux))

        # Rows that draft: the head's output at their last position gives draft 1.
        drafting = [i for i, r in enumerate(rows) if caps[r] > 0]
        if not drafting:
            # Queued, not waited for: no draft is read now, and the next step's reads of the
            # head's K/V come after these writes in MLX's graph.
            mx.async_eval(*self.pool.arrays())
            return drafts
        last = mx.array((first.cu_seqlens_q[1:][drafting] - 1).astype(np.int32))
        rows = rows[drafting]
        normed, hidden = normed[last], hidden[last]
        positions = start[rows] + count[rows] - 1
        for j in range(int(caps[rows].max())):
            if j > 0:
                keep = caps[rows] > j
                rows, positions = rows[keep], positions[keep]
                if rows.size == 0:
                    break
                hidden = hidden[mx.array(np.nonzero(keep)[0].astype(np.int32))]
                positions = positions + 1
                fed = decode_batch(
                    [req_ids[r] for r in rows],
                    positions,
                    np.array([drafts[r][-1] for r in rows], dtype=np.int32),
                    [t[rows] for t in tables],
                    states.block_sizes,
                )
                normed, hidden = self._run(fed, hidden)
            tokens = self.head.draft_tokens(self._logits(normed))
            mx.eval(tokens, hidden, *self.pool.arrays())
            for r, token in zip(rows, np.array(tokens).tolist()):
                drafts[r].append(int(token))
        return drafts

    def _run(self, packed: PackedBatch, hidden: mx.array) -> tuple[mx.array, mx.array]:
        """The head over `packed` (tokens at p + 1, positions p) with the hidden states of its
        rows: (normed output, the hidden state the next draft step reads)."""
        head = self.head
        caches = layer_caches(self.pool, packed, self.kinds)
        token_ids = mx.array(packed.token_ids)[:, None]
        if head.embed_tokens is not None:
            embeds = head.embed_tokens(token_ids)
        else:
            embeds = self.target.adapter.embed(token_ids)
        return head(embeds, hidden, caches)

    def _logits(self, normed: mx.array) -> mx.array:
        head = self.head
        logits = (
            head.lm_head(normed) if head.lm_head is not None else self.target.adapter.logits(normed)
        )
        return logits.reshape(normed.shape[0], -1)
