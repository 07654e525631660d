"""The encoder's share of a step's memory peak, measured on vLLM's own dummy items.

vLLM's `MultiModalBudget` knows the modality whose items take the most placeholder tokens and how
many of them one step may encode within the encoder budget; its processor builds the largest
such item. Encoding that many copies, as vLLM's GPU runner does when it profiles, bounds what the
towers add to a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from vllm_metal.backends.mlx.runner.mm.embeddings import item_tensors
from vllm_metal.backends.mlx.runner.warmup import activation_peak

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.models.multimodal import MultimodalAdapter


def encoder_peak(vllm_config: VllmConfig, adapter: MultimodalAdapter) -> int:
    """Peak bytes of encoding the most items of the largest kind one step may schedule."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
    dummies = budget.get_dummy_encoder_profile_inputs()
    if not dummies:
        return 0
    modality, item = dummies[0]
    tensors = item_tensors(item)

    def run() -> None:
        mx.eval(adapter.embed_multimodal(modality, [tensors] * len(dummies)))

    peak = activation_peak(run)
    mx.clear_cache()
    return peak
