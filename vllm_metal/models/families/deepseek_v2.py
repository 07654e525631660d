"""DeepSeek-V2 (and V2-Lite): DeepSeek-V3's multi-head latent attention with softmax-routed MoE
blocks (greedy or group-limited top-k, shared experts) after `first_k_dense_replace` dense layers,
YaRN RoPE whose `mscale_all_dim` also scales the softmax, and, in V2-Lite, no query LoRA.
mlx-lm's attention keeps the whole key/value up-projection `kv_b_proj` and expands the latent
per head; here it is split once at load into the per-head key and value parts
(`deepseek_v3.absorb_kv_b_proj`) and the layers run DeepSeek-V3's absorbed attention over the
paged latent cache (`deepseek_v3.paged_latent_attention`), with mlx-lm's softmax scale and
rotary embedding as they are. Mirrors mlx-lm 0.32.2 (`models/deepseek_v2.py`).
"""

from __future__ import annotations

from mlx_lm.models.deepseek_v2 import DeepseekV2Attention

from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.models.families import deepseek_v3

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("deepseek_v2",)
KIND = "latent_attention"
MODALITIES: tuple[str, ...] = ()


class Adapter(deepseek_v3.Adapter):
    def install_paged_attention(self) -> None:
        for layer in self.model.layers:
            deepseek_v3.absorb_kv_b_proj(layer.self_attn)
        patch_attention_class(
            DeepseekV2Attention, deepseek_v3.paged_latent_attention, LatentLayerCache
        )
