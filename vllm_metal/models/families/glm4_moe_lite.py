"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's multi-head latent attention and sigmoid-routed
MoE at other sizes (value heads wider than the non-rotary query part). mlx-lm's attention class
has the same parts as DeepSeek-V3's (`embed_q`, `unembed_out`, the query LoRA, the latent norm),
so its layers run the same absorbed attention over the paged latent cache
(`deepseek_v3.paged_latent_attention`). Mirrors mlx-lm 0.32.2 (`models/glm4_moe_lite.py`).
"""

from __future__ import annotations

from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteAttention

from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.latent import LatentLayerCache
from vllm_metal.models.families import deepseek_v3

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("glm4_moe_lite",)
KIND = "latent_attention"
MODALITIES: tuple[str, ...] = ()


class Adapter(deepseek_v3.Adapter):
    def install_paged_attention(self) -> None:
        patch_attention_class(
            Glm4MoeLiteAttention, deepseek_v3.paged_latent_attention, LatentLayerCache
        )
