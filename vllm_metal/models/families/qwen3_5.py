"""Qwen3.5 / 3.6 (dense and MoE): Qwen3-Next's layer mix (three Gated DeltaNet layers to each
gated full-attention layer, a quarter of each head rotated) in a vision-language wrapper, with
dense MLPs or MoE blocks beside a shared expert. The MLX runner serves the language model of
the wrapper (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`), alone
where the towers do not run (`config.multimodal`) or with them (`families.qwen3_5_vl`), and the
text-only `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`.

mlx-lm's `qwen3_5` classes take Qwen3-Next's attention, norms and MoE block; their Gated DeltaNet
differs only in its input projections (q, k, v in one block, then z, b and a apart, where
Qwen3-Next interleaves them per key head), so after those it runs Qwen3-Next's packed layer
(`qwen3_next.packed_gated_delta`) on the request's state pages. mlx-lm knows the wrapper's
model types; the text-only ones (`qwen3_5_text`, `qwen3_5_moe_text`) load through the same
modules (`MLX_LM_MODULES`), and expert tensors saved one per expert are stacked (`sanitize`).
Mirrors mlx-lm 0.32.2 (`models/qwen3_5.py`, `models/qwen3_5_moe.py`).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.families.qwen3_next import packed_gated_delta

# What this family is to the capability table (`vllm_metal.config.kinds`).
# (The wrappers' model types are `families.qwen3_5_vl`'s; their text configs are these.)
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
KIND = "state_hybrid"
MODALITIES: tuple[str, ...] = ()

# model_type -> the mlx-lm module that reads it (mlx-lm knows only the wrappers' model types;
# its classes take a config without `text_config` as the text model's).
MLX_LM_MODULES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


class Adapter(ModelAdapter):
    def install_paged_attention(self) -> None:
        # The attention class is Qwen3-Next's, which calls its own module's attention.
        layer = next(layer for layer in self.model.layers if not layer.is_linear)
        attention.route_module_sdpa(layer.self_attn)
        attention.patch_attention_class(GatedDeltaNet, _packed_gated_delta_net, StateLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # Qwen3_5TextModel.__call__


@state_layer
def _packed_gated_delta_net(
    layer: GatedDeltaNet, inputs: mx.array, cache: StateLayerCache
) -> mx.array:
    """The layer over packed rows (`[T, 1, hidden]`, each row one token of some request)."""
    t = inputs.shape[0]
    return packed_gated_delta(
        layer,
        layer.in_proj_qkv(inputs).reshape(t, -1),
        layer.in_proj_z(inputs),
        layer.in_proj_b(inputs),
        layer.in_proj_a(inputs),
        cache,
    )


_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Stack expert tensors saved one per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as
    transformers saves the MoE model) into mlx-lm's `mlp.switch_mlp.*` layout; mlx-lm's own
    `sanitize` reads only the fused `experts.gate_up_proj` layout."""
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    out = {}
    for name, value in weights.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = value
        else:
            experts.setdefault((match[1], match[3]), {})[int(match[2])] = value
    for (mlp, proj), by_index in experts.items():
        out[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack(
            [by_index[e] for e in range(len(by_index))]
        )
    return out
