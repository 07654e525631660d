"""Drafts from the target's own multi-token-prediction head (`--speculative-config
'{"method": "mtp"}'`; the head of each family: `models/families/*_mtp.py`).

The head at position p reads the target's final hidden state at p and the token at p + 1, and
predicts the token at p + 2; its attention layers keep K/V in the target's KV-cache group (names
prefixed `mtp.`), at p's slot. It runs after the target over each request's positions, and a
draft chain is fed draft j and the head's own output before it, as vLLM chains MTP drafts
(`head.py`: when the head runs, and how a request that does not draft waits). Drafts are the
head's argmax (vLLM's `draft_sample_method="greedy"`). With prefix caching vLLM's scheduler
drops the last block of a hit for MTP drafters, and the head has run over every complete block,
so its K/V in a hit's blocks was computed from the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from vllm_metal.backends.mlx.runner import compiled
from vllm_metal.backends.mlx.runner.batch import PackedBatch
from vllm_metal.backends.mlx.runner.spec_decode.head import HeadDrafter
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models.families import mtp_module
from vllm_metal.ops.argmax import row_argmax

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.step import StepState

# Prefix of the MTP head's layer names in vLLM's KV-cache config.
MTP_LAYER_PREFIX = "mtp."


class MTPDrafter(HeadDrafter):
    reads_hidden_states = True

    def __init__(self, vllm_config: VllmConfig, target: ModelState, *, kv_dtype: mx.Dtype):
        model_config = vllm_config.model_config
        super().__init__(
            model_config.get_num_kv_heads(vllm_config.parallel_config),
            model_config.get_head_size(),
            kv_dtype,
            draft_cache_config(vllm_config),
            compile_chain=compiled.enabled(vllm_config),
        )
        self.target = target
        self.model_path = model_config.model
        self.revision = model_config.revision
        self.download_dir = vllm_config.load_config.download_dir

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        adapter = self.target.adapter
        module = mtp_module(adapter.model_type)
        if module is None:  # the capability table refuses this at startup
            raise ValueError(f"{adapter.model_type}: no multi-token-prediction head is built")
        path = resolve_model_path(self.model_path, self.revision, self.download_dir)
        self.head = module.load_head(adapter.config, path, self.target.compute_dtype)
        self.kinds = self.head.layer_kinds()
        self.layer_names = [
            f"{MTP_LAYER_PREFIX}layers.{i}.self_attn" for i in range(len(self.kinds))
        ]

    # ------------------------------------------------------------ the head's pass

    def _step_inputs(self, step: StepState) -> mx.array:
        assert step.hidden is not None, "the step kept no hidden states"
        return step.hidden

    def _first(self, packed: PackedBatch, inputs: mx.array) -> tuple[mx.array, mx.array]:
        return self._run(packed, inputs, 0)

    def _draft_tokens(self, out: mx.array) -> mx.array:
        return row_argmax(self.target.adapter.logits(out).reshape(out.shape[0], -1))

    def _pass(
        self, token_ids: mx.array, hidden: mx.array, caches: list, j: int
    ) -> tuple[mx.array, mx.array]:
        """The head over tokens `[T, 1]` (at p + 1, their rows at positions p) with the hidden
        states of its rows, its K/V written to layer `j mod layers`: the normed output the LM
        head reads, and the hidden state a chained step is fed (a head returning one array
        feeds it back)."""
        layer = j % len(self.kinds)
        embeds = self.target.adapter.embed(token_ids)
        out = self.head(embeds, hidden, caches[layer], j)
        return out if isinstance(out, tuple) else (out, out)
