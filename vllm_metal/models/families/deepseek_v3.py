"""DeepSeek-V3: multi-head latent attention (MLA) and sigmoid-routed MoE blocks with shared experts
after `first_k_dense_replace` dense layers. mlx-lm's decoder takes no input embeddings; its
attention already splits the key/value up-projection per head (`embed_q`, `unembed_out`, which
its `sanitize` cuts from `kv_b_proj`). Here every attention layer runs in the absorbed form over
the paged latent cache (`kv.latent`): the query's non-rotary part is carried into the latent
space by `embed_q` and joined with its rotary part, the step's latent rows (normed latent, then
the rotary key) are written, `ops.mla_attention` mixes the cached latents, and `unembed_out`
maps each head's mix to its values. Mirrors mlx-lm 0.32.2 (`models/deepseek_v3.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LATENT, LayerKind

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("deepseek_v3",)
KIND = "latent_attention"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def layer_kinds(self) -> list[LayerKind]:
        return [LATENT] * self.num_layers

    def install_paged_attention(self) -> None:
        patch_attention_class(DeepseekV3Attention, paged_latent_attention, LatentLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # DeepseekV3Model.__call__


def paged_latent_attention(
    attn: DeepseekV3Attention, x: mx.array, cache: LatentLayerCache
) -> mx.array:
    """The layer over packed rows (`[T, 1, hidden]`, each row one token of some request)."""
    t, heads = x.shape[0], attn.num_heads
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.reshape(t, heads, 1, attn.q_head_dim)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    latent = attn.kv_a_layernorm(latent)  # [T, 1, kv_lora_rank]
    q_pe = attn.rope(q_pe, cache.offset)  # [T, H, 1, rope_dim]
    k_pe = attn.rope(k_pe.reshape(t, 1, 1, attn.qk_rope_head_dim), cache.offset)
    cache.write(mx.concatenate([latent.reshape(t, -1), k_pe.reshape(t, -1)], axis=-1))
    queries = mx.concatenate([attn.embed_q(q_nope), q_pe], axis=-1).reshape(t, heads, -1)
    mixed = cache.attend(queries, attn.scale, attn.kv_lora_rank)  # [T, H, kv_lora_rank]
    out = attn.unembed_out(mixed[:, :, None, :])  # [T, H, 1, v_head_dim]
    return attn.o_proj(out.reshape(t, 1, heads * attn.v_head_dim))
