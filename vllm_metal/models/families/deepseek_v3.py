"""DeepSeek-V3: multi-head latent attention (MLA) and sigmoid-routed MoE blocks with shared experts
after `first_k_dense_replace` dense layers. mlx-lm's decoder takes no input embeddings; its
attention already splits the key/value up-projection per head (`embed_q`, `unembed_out`, which
its `sanitize` cuts from `kv_b_proj`). Here every attention layer runs in the absorbed form over
the paged latent cache (`kv.latent`): the query's non-rotary part is carried into the latent
space by `embed_q` and joined with its rotary part, the step's latent rows (normed latent, then
the rotary key) are written, `ops.mla_attention` mixes the cached latents, and `unembed_out`
maps each head's mix to its values. The other MLA families reuse that call, their layers' shape
(`latent_kind`) and, where mlx-lm keeps the whole `kv_b_proj`, its split (`absorb_kv_b_proj`).
Mirrors mlx-lm 0.32.2 (`models/deepseek_v3.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention
from mlx_lm.models.mla import MultiLinear

from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import LayerKind

# What this family is to the capability table (`vllm_metal.config.kinds`).
# Kimi K2 is DeepSeek-V3 under its own model_type (vLLM and mlx-lm read it as deepseek_v3).
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
KIND = "latent_attention"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def layer_kinds(self) -> list[LayerKind]:
        return [latent_kind(layer.self_attn) for layer in self.model.layers]

    def install_paged_attention(self) -> None:
        patch_attention_class(DeepseekV3Attention, paged_latent_attention, LatentLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        return self.decode_layers(input_embeds, caches)  # DeepseekV3Model.__call__


def latent_kind(attn: Any) -> LayerKind:
    """A latent layer with its own row shape: one KV head as wide as the latent plus the rotary key
    (what vLLM's MLA config says for DeepSeek, and what it does not know for MiniCPM3)."""
    return LayerKind(
        latent=True, num_kv_heads=1, head_dim=attn.kv_lora_rank + attn.qk_rope_head_dim
    )


def absorb_kv_b_proj(attn: Any) -> None:
    """Replace the key/value up-projection `kv_b_proj` (`[H * (nope + v), kv_lora_rank]`, mlx-lm's
    DeepSeek-V2 and MiniCPM3 attention) by its per-head parts in the absorbed form that
    `paged_latent_attention` runs: `embed_q` (`[H, kv_lora_rank, nope]`, the key rows, which carry
    a query into the latent space) and `unembed_out` (`[H, v, kv_lora_rank]`, the value rows). A
    quantized `kv_b_proj` is dequantized (its own scales' dtype): the split runs across its rows,
    and the transposed key part would not keep its quantization groups."""
    proj = attn.kv_b_proj
    if isinstance(proj, nn.QuantizedLinear):
        weight = mx.dequantize(
            proj.weight,
            proj.scales,
            proj.get("biases"),
            group_size=proj.group_size,
            bits=proj.bits,
            mode=proj.mode,
        )
    elif isinstance(proj, nn.Linear):
        weight = proj.weight
    else:
        raise TypeError(
            f"vllm-metal: {type(attn).__name__}.kv_b_proj is a {type(proj).__name__}; the latent "
            "attention splits a Linear or an MLX-quantized QuantizedLinear"
        )
    heads, nope, rank = attn.num_heads, attn.qk_nope_head_dim, attn.kv_lora_rank
    per_head = weight.reshape(heads, nope + attn.v_head_dim, rank)
    attn.embed_q = MultiLinear(nope, rank, heads)
    attn.embed_q.weight = mx.contiguous(per_head[:, :nope, :].swapaxes(-1, -2))
    attn.unembed_out = MultiLinear(rank, attn.v_head_dim, heads)
    attn.unembed_out.weight = mx.contiguous(per_head[:, nope:, :])
    attn.pop("kv_b_proj")
    mx.eval(attn.embed_q.weight, attn.unembed_out.weight)


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
