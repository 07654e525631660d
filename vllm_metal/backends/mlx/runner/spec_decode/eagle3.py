"""Drafts from an EAGLE-3 head (`--speculative-config '{"method": "eagle3", "model": ...}'`; the
head: `models/families/eagle3.py`).

The head reads the target's hidden states at a few layers (the step keeps them for every packed
token: `StepState.aux_hidden`), and runs after the target as the target's own MTP head does
(`head.py`): position p fed the token at p + 1 and `fc` of the target's aux states at p, each
layer writing its K/V into its own layer (`eagle3.layers.N.self_attn`, declared to vLLM beside
the target's, in the target's full-attention group). A drafting request's first draft is the
argmax of the head's output at its last position; draft j + 1 comes from the head at the next
position fed draft j and the head's own pre-norm output before it, as vLLM's EAGLE proposer
chains them. Draft-vocabulary argmaxes map to target tokens through `d2t`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from vllm_metal.backends.mlx.runner import compiled
from vllm_metal.backends.mlx.runner.batch import PackedBatch
from vllm_metal.backends.mlx.runner.spec_decode.head import HeadDrafter
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models.families import eagle3
from vllm_metal.models.layers import FULL_ATTENTION

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.step import StepState

# Prefix of the head's layer names in vLLM's KV-cache config.
EAGLE3_LAYER_PREFIX = "eagle3."


class Eagle3Drafter(HeadDrafter):
    def __init__(self, vllm_config: VllmConfig, target: ModelState, *, kv_dtype: mx.Dtype):
        spec = vllm_config.speculative_config
        self.draft_config = spec.draft_model_config
        super().__init__(
            self.draft_config.get_num_kv_heads(spec.draft_parallel_config),
            self.draft_config.get_head_size(),
            kv_dtype,
            draft_cache_config(vllm_config),
            compile_chain=compiled.enabled(vllm_config),
        )
        self.target = target
        self.download_dir = vllm_config.load_config.download_dir
        self.num_target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        # vLLM numbers the head's layers after the target's (`llama_eagle3.py`: start_layer_id).
        self.first_layer_index = self.num_target_layers
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        self.draft = self.draft_config.hf_config.to_dict()
        self.architecture = self.draft_config.architectures[0]
        self.aux_layer_ids = eagle3.aux_layer_ids(self.draft, self.num_target_layers)

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

    # ------------------------------------------------------------ the head's pass

    def _step_inputs(self, step: StepState) -> mx.array:
        assert step.aux_hidden is not None, "the step kept no aux hidden states"
        return step.aux_hidden

    def _first(self, packed: PackedBatch, inputs: mx.array) -> tuple[mx.array, mx.array]:
        return self._run(packed, self.head.combine(inputs), 0)

    def _draft_tokens(self, out: mx.array) -> mx.array:
        return self.head.draft_tokens(self._logits(out))

    def _pass(
        self, token_ids: mx.array, hidden: mx.array, caches: list, j: int
    ) -> tuple[mx.array, mx.array]:
        """The head over tokens `[T, 1]` (at p + 1, their rows at positions p) with the hidden
        states of its rows: (normed output, the hidden state the next draft step reads). Every
        pass is the same, `j` aside."""
        head = self.head
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
