"""MiniCPM3: a dense decoder with DeepSeek-V2's multi-head latent attention, plain (half-split)
LongRoPE, and muP scalings: embeddings times `scale_emb`, residual branches times
`scale_depth / sqrt(num_layers)` (inside mlx-lm's decoder layers, which `decode_layers` runs),
and the final hidden states divided by `hidden_size / dim_model_base` before the head. mlx-lm's
decoder takes no input embeddings, so `forward` applies `scale_emb` itself; its head scales only
an untied `lm_head`, so `logits` scales before a tied one, as transformers does for both.
The attention's `kv_b_proj` is split at load into per-head key and value parts
(`deepseek_v3.absorb_kv_b_proj`) and the layers run DeepSeek-V3's absorbed attention over the
paged latent cache with the attention's `softmax_scale`. vLLM sizes MiniCPM3 as plain attention
(it is no MLA model to vLLM's config), so the layers declare the latent row's shape themselves
(`deepseek_v3.latent_kind`). The query and latent norms take transformers' epsilon (1e-6; mlx-lm
builds them with its default 1e-5). mlx-lm's LongRoPE rotates every position by the long factors;
where a checkpoint's short factors differ, positions below `original_max_position_embeddings`
take the short ones (`ShortLongRoPE`), as transformers does for sequences within that length and
vLLM does by position. Mirrors mlx-lm 0.32.2 (`models/minicpm3.py`, `models/rope_utils.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.minicpm3 import Attention
from mlx_lm.models.rope_utils import SuScaledRoPE

from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.models.families import deepseek_v3

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("minicpm3",)
KIND = "latent_attention"
MODALITIES: tuple[str, ...] = ()

# transformers' (and the published model code's) RMSNorm epsilon of the query LoRA and latent.
_LORA_NORM_EPS = 1e-6


class Adapter(deepseek_v3.Adapter):
    def install_paged_attention(self) -> None:
        args = self.model.args
        scaling = args.rope_scaling or {}
        short = scaling.get("short_factor", 1.0)
        for layer in self.model.layers:
            attn = layer.self_attn
            deepseek_v3.absorb_kv_b_proj(attn)
            attn.scale = attn.softmax_scale  # the name `paged_latent_attention` reads
            attn.q_a_layernorm.eps = attn.kv_a_layernorm.eps = _LORA_NORM_EPS
            if short != scaling.get("long_factor", 1.0):
                original = scaling.get("original_max_position_embeddings", 4096)
                attn.rope = ShortLongRoPE(attn.rope, short, args.rope_theta, original)
        patch_attention_class(Attention, deepseek_v3.paged_latent_attention, LatentLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        # MiniCPM3Model.__call__, which scales the embeddings first.
        return self.decode_layers(input_embeds * self.decoder.args.scale_emb, caches)

    def logits(self, hidden: mx.array) -> mx.array:
        args = self.model.args
        if args.tie_word_embeddings:
            hidden = hidden / (args.hidden_size / args.dim_model_base)
        return super().logits(hidden)


class ShortLongRoPE(nn.Module):
    """mlx-lm's LongRoPE (`long`, long factors and its magnitude scale) with the short factors at
    positions below `original` (`offset`: one position per packed row, `[T]`)."""

    def __init__(self, long: SuScaledRoPE, short_factor: Any, base: float, original: int):
        super().__init__()
        self.long = long
        dims = long.dim
        self._short_freqs = mx.array(short_factor, dtype=mx.float32) * base ** (
            mx.arange(0, dims, 2, dtype=mx.float32) / dims
        )
        self._original = original

    def __call__(self, x: mx.array, offset: mx.array) -> mx.array:
        dims = self.long.dim
        short = mx.fast.rope(
            x.at[..., :dims].multiply(self.long._scale),
            dims,
            traditional=False,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._short_freqs,
        )
        below = (offset < self._original).reshape(-1, *([1] * (x.ndim - 1)))
        return mx.where(below, short, self.long(x, offset))
