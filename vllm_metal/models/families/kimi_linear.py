"""Kimi-Linear: Kimi Delta Attention (KDA) layers between multi-head latent attention (MLA) layers
that apply no rotary embedding, and sigmoid-routed MoE blocks with a shared expert. mlx-lm's
decoder takes no input embeddings; its KDA layer keeps a dense per-batch state and its MLA layer
a dense cache. Here a KDA layer reads and writes its requests' state pages
(`kv.state.StateLayerCache`): one short convolution over q, k and v side by side
(`ops.causal_conv1d`, vLLM's one KDA window) and the gated delta rule with a per-channel decay
(`ops.gated_delta_rule`, whose native kernel takes a per-head decay only, so this runs its
pure-MLX reference on every device). An MLA layer runs DeepSeek-V3's absorbed attention over the
paged latent cache (`kv.latent`) without the rotary step: its "rope" part is a plain shared key.
The state pages live in the latent cache's regions. Mirrors mlx-lm 0.32.2
(`models/kimi_linear.py`, `models/gated_delta.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, normalize_qk
from mlx_lm.models.kimi_linear import KimiDeltaAttention, KimiMLAAttention

from vllm_metal import ops
from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LATENT, LayerKind, state_shapes_of

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("kimi_linear",)
KIND = "latent_state_hybrid"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def layer_kinds(self) -> list[LayerKind]:
        state = LayerKind(is_state=True, state=state_shapes_of(self.model_type, self.config))
        return [state if layer.is_linear else LATENT for layer in self.model.layers]

    def install_paged_attention(self) -> None:
        patch_attention_class(KimiMLAAttention, _paged_nope_latent_attention, LatentLayerCache)
        patch_attention_class(KimiDeltaAttention, _packed_delta_attention, StateLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # KimiLinearModel.__call__


@state_layer
def _packed_delta_attention(
    layer: KimiDeltaAttention, x: mx.array, cache: StateLayerCache
) -> mx.array:
    """The KDA layer over packed rows (`[T, 1, hidden]`, each row one token of some request)."""
    t, heads, head_dim = x.shape[0], layer.num_heads, layer.head_dim
    width = heads * head_dim
    mixed = mx.concatenate([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], axis=-1)
    convs = (layer.q_conv, layer.k_conv, layer.v_conv)
    weight = mx.concatenate([c.conv.weight[:, :, 0] for c in convs], axis=0)  # [3 width, K]
    conv_state, state = cache.read()
    conv_out, conv_state = ops.causal_conv1d(
        mixed.reshape(t, -1), weight, conv_state, cache.cu_seqlens, max_query_len=cache.query_rows
    )
    q, k, v = mx.split(conv_out, [width, 2 * width], axis=-1)
    shape = (t, heads, head_dim)
    q, k = normalize_qk(q.reshape(shape), k.reshape(shape), inv_scale=layer.scale, eps=1e-6)
    decay_logits = layer.f_b_proj(layer.f_a_proj(x)).reshape(shape)
    g = compute_g(
        layer.A_log.reshape(heads, 1), decay_logits, layer.dt_bias.reshape(heads, head_dim)
    ).astype(mx.float32)  # [T, heads, head_dim]: one decay per key channel
    beta = mx.sigmoid(layer.b_proj(x)).reshape(t, heads).astype(mx.float32)
    out, state = ops.gated_delta_rule(
        q, k, v.reshape(shape), g, beta, state, cache.cu_seqlens, cache.query_rows
    )
    cache.write(conv_state, state)
    gate = layer.g_b_proj(layer.g_a_proj(x)).reshape(shape)
    out = layer.o_norm(out.reshape(shape)) * mx.sigmoid(gate)
    return layer.o_proj(out.reshape(t, 1, width))


def _paged_nope_latent_attention(
    attn: KimiMLAAttention, x: mx.array, cache: LatentLayerCache
) -> mx.array:
    """The MLA layer over packed rows: `deepseek_v3.paged_latent_attention` without rotary
    embeddings (the shared key part enters the scores as it is)."""
    t, heads = x.shape[0], attn.num_heads
    q = attn.q_proj(x).reshape(t, heads, 1, attn.q_head_dim)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    latent = attn.kv_a_layernorm(latent)  # [T, 1, kv_lora_rank]
    cache.write(mx.concatenate([latent.reshape(t, -1), k_pe.reshape(t, -1)], axis=-1))
    queries = mx.concatenate([attn.embed_q(q_nope), q_pe], axis=-1).reshape(t, heads, -1)
    mixed = cache.attend(queries, attn.scale, attn.kv_lora_rank)  # [T, H, kv_lora_rank]
    out = attn.unembed_out(mixed[:, :, None, :])  # [T, H, 1, v_head_dim]
    return attn.o_proj(out.reshape(t, 1, heads * attn.v_head_dim))
