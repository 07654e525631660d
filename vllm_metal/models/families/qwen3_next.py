"""Qwen3-Next: Gated DeltaNet (linear-attention) layers, three to each gated full-attention layer,
and MoE blocks with a shared expert. mlx-lm's decoder takes no input embeddings, and its
linear-attention layer keeps a dense per-batch state; here that layer reads and writes its
requests' state pages (`kv.state.StateLayerCache`) and runs the packed ops
`ops.causal_conv1d` and `ops.gated_delta_rule` over the step's varlen batch. The full-attention
layers go through the paged attention like any mlx-lm family. Mirrors mlx-lm 0.32.2
(`models/qwen3_next.py`, `models/gated_delta.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, normalize_qk
from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

from vllm_metal import ops
from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("qwen3_next",)
KIND = "state_hybrid"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def install_paged_attention(self) -> None:
        super().install_paged_attention()
        patch_attention_class(Qwen3NextGatedDeltaNet, _packed_gated_delta_net, StateLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # Qwen3NextModel.__call__


@state_layer
def _packed_gated_delta_net(
    layer: Qwen3NextGatedDeltaNet, inputs: mx.array, cache: StateLayerCache
) -> mx.array:
    """The layer over packed rows (`[T, 1, hidden]`, each row one token of some request)."""
    t = inputs.shape[0]
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(
        layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs)
    )
    mixed = mx.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
    return packed_gated_delta(layer, mixed, z, b, a, cache)


def packed_gated_delta(
    layer: Any, mixed: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: StateLayerCache
) -> mx.array:
    """A Gated DeltaNet layer after its input projections, over a step's packed rows: the short
    convolution and the gated delta rule continue each request from its state page, then the
    gated norm and the output projection. `mixed` [T, 2 key_dim + value_dim] holds q, k, v in
    that order; `z` [T, ..., value_dim] the gate; `b`, `a` [T, ..., num_v_heads] (Qwen3-Next
    and Qwen3.5 differ only in how their projections lay these out)."""
    t = mixed.shape[0]
    nk, dk = layer.num_k_heads, layer.head_k_dim
    nv, dv = layer.num_v_heads, layer.head_v_dim
    conv_state, state = cache.read()
    conv_out, conv_state = ops.causal_conv1d(
        mixed,
        layer.conv1d.weight[:, :, 0],
        conv_state,
        cache.cu_seqlens,
        max_query_len=cache.query_rows,
    )
    q, k, v = mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], axis=-1)
    q, k = normalize_qk(q.reshape(t, nk, dk), k.reshape(t, nk, dk), inv_scale=dk**-0.5, eps=1e-6)
    beta = mx.sigmoid(b).reshape(t, nv).astype(mx.float32)
    g = compute_g(layer.A_log, a.reshape(t, nv), layer.dt_bias).astype(mx.float32)
    out, state = ops.gated_delta_rule(
        q, k, v.reshape(t, nv, dv), g, beta, state, cache.cu_seqlens, cache.query_rows
    )
    cache.write(conv_state, state)
    out = layer.norm(out.reshape(t, 1, nv, dv), z.reshape(t, 1, nv, dv))
    return layer.out_proj(out.reshape(t, 1, -1))
