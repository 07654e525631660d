"""Nemotron-H (Nemotron-H, Nemotron 3 Nano): a stack of Mamba-2 layers, attention layers without
RoPE, and layers that are only an MLP (relu^2) or only a MoE block (sigmoid-routed experts and a
shared expert), each one residual block around one mixer. Only the Mamba-2 and attention layers
keep memory: the runner's layer kinds, names and caches are theirs, in model order, and `forward`
hands each block its cache (none to the MLP and MoE blocks). The Mamba-2 mixers run Granite
4.0-H's packed layer (`granitemoehybrid.packed_mamba2_mixer`) on the requests' state pages.
mlx-lm's decoder (`backbone`) takes no input embeddings and its head is `lm_head` beside it.

transformers clamps a step's dt from below at `time_step_min` (0.001 as published) where mlx-lm
and vLLM clamp at 0 (`time_step_limit`); mlx-lm's is what runs here, as vLLM's own model does.
Mirrors mlx-lm 0.32.2 (`models/nemotron_h.py`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import mlx.core as mx
from mlx_lm.models.nemotron_h import NemotronHMamba2Mixer

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.kv.state import StateLayerCache
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.families.granitemoehybrid import packed_mamba2_mixer
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, state_shapes_of

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("nemotron_h",)
KIND = "state_hybrid"
MODALITIES: tuple[str, ...] = ()

# The blocks with memory: Mamba-2 ("M") and attention ("*").
_WITH_MEMORY = ("M", "*")


class Adapter(ModelAdapter):
    @property
    def decoder(self) -> Any:
        return self.model.backbone

    @cached_property
    def attention_layer_names(self) -> list[str]:
        return [
            f"backbone.layers.{i}.mixer"
            for i, layer in enumerate(self.model.layers)
            if layer.block_type in _WITH_MEMORY
        ]

    def layer_kinds(self) -> list[LayerKind]:
        state = LayerKind(is_state=True, state=state_shapes_of(self.model_type, self.config))
        return [
            state if layer.block_type == "M" else FULL_ATTENTION
            for layer in self.model.layers
            if layer.block_type in _WITH_MEMORY
        ]

    def install_paged_attention(self) -> None:
        attention.route_module_sdpa(self.model)
        attention.patch_attention_class(NemotronHMamba2Mixer, packed_mamba2_mixer, StateLayerCache)

    def embed(self, token_ids: mx.array) -> mx.array:
        return self.decoder.embeddings(token_ids)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        """NemotronHModel.__call__ over packed rows, `caches` those of the blocks with memory."""
        remaining = iter(caches)
        h = input_embeds
        for layer in self.model.layers:
            cache = next(remaining) if layer.block_type in _WITH_MEMORY else None
            h = layer(h, mask=None, cache=cache)
        return self.decoder.norm_f(h)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.model.lm_head(hidden)
