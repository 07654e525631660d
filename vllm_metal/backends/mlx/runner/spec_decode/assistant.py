"""Drafts from a multi-token-prediction assistant, a checkpoint of its own that attends over the
target's K/V (`--speculative-config '{"method": "mtp", "model": ASSISTANT}'`; Gemma 4's:
`models/families/gemma4_mtp.py`).

The assistant keeps no K/V: its layers read the target's pages of the step (`StepState.kv_pool`)
through the target's block tables. A request that drafts after a step starts from the last
position p the target computed and kept (`head.new_positions`): the assistant takes the token at
p + 1 (the one just sampled) with the target's hidden state at p (`StepState.hidden`) and gives
draft 1 and a hidden state of the target's width; draft j + 1 comes from draft j and that hidden
state, at the same position p over the same K/V (vLLM's constant draft positions). A request
that does not draft costs the assistant nothing, and nothing needs catching up: prefix-cache
hits, preemption and new turns are the target's K/V as they are. Drafts are the assistant's
argmax (vLLM's `draft_sample_method="greedy"`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import decode_batch
from vllm_metal.backends.mlx.runner.forward import attention_cache, step_metadata
from vllm_metal.backends.mlx.runner.spec_decode.drafter import (
    Drafter,
    HeadWeights,
    block_tables,
    sampled_counts,
)
from vllm_metal.backends.mlx.runner.spec_decode.head import new_positions
from vllm_metal.models.families import mtp_module

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState


class AssistantDrafter(HeadWeights, Drafter):
    reads_hidden_states = True
    reads_target_kv = True

    def __init__(self, vllm_config: VllmConfig, target: ModelState):
        draft = vllm_config.speculative_config.draft_model_config
        self.target = target
        self.model_path = draft.model
        self.revision = draft.revision
        self.download_dir = vllm_config.load_config.download_dir
        self.sources: list[int] = []  # the target layer each assistant layer attends over

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        adapter = self.target.adapter
        module = mtp_module(adapter.model_type)
        if module is None or module.HEAD_IN_TARGET:  # the capability table refuses this
            raise ValueError(f"{adapter.model_type}: no multi-token-prediction assistant is built")
        path = resolve_model_path(self.model_path, self.revision, self.download_dir)
        self.head, self.sources = module.load_assistant(
            path, adapter.config, self.target.compute_dtype
        )

    # ------------------------------------------------------------ drafting

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.head is not None, "MTP assistant not loaded"
        assert step.hidden is not None and step.kv_pool is not None, "the step kept no K/V"
        batch = states.input_batch
        n = batch.num_reqs
        drafts: list[list[int]] = [[] for _ in range(n)]
        start, count = new_positions(step, states, sampled_counts(sampled))
        rows = np.nonzero((count > 0) & (caps[:n] > 0))[0]
        if rows.size == 0:
            return drafts
        positions = start[rows] + count[rows] - 1
        # The target's hidden state at p, and the token at p + 1.
        gather = step.packed.cu_seqlens_q[rows] + count[rows] - 1
        hidden = step.hidden[mx.array(gather.astype(np.int32))]
        tokens = batch.token_ids_cpu[rows, positions + 1].astype(np.int32)
        tables = block_tables(states, len(step.packed.block_tables))
        caches = None
        for j in range(int(caps[rows].max())):
            keep = caps[rows] > j
            if caches is None or not keep.all():
                if not keep.all():
                    kept = mx.array(np.nonzero(keep)[0].astype(np.int32))
                    rows, positions, tokens = rows[keep], positions[keep], tokens[keep]
                    hidden = hidden[kept]
                packed = decode_batch(
                    [batch.req_ids[r] for r in rows],
                    positions,
                    tokens,
                    [t[rows] for t in tables],
                    states.block_sizes,
                )
                meta = step_metadata(packed)
                kinds = self.target.layer_kinds
                caches = [
                    attention_cache(step.kv_pool, i, kinds[i], meta, False) for i in self.sources
                ]
            embeds = self.target.adapter.embed(mx.array(tokens)[:, None])
            out, hidden = self.head(mx.concatenate([embeds, hidden], axis=-1), caches)
            drafted = self.head.argmax(out)
            mx.eval(drafted, hidden)
            tokens = np.array(drafted).astype(np.int32)
            for r, token in zip(rows, tokens.tolist()):
                drafts[r].append(int(token))
        return drafts
