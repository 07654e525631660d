"""Gemma 3 (vision-language): a SigLIP tower, an average-pooling projector and the Gemma 3 text
model, through mlx-vlm's `gemma3` classes.

vLLM's processor gives each image `pixel_values` (`[crops, 3, S, S]`, normalised: the image,
plus its pan-and-scan crops when those are asked for) and `num_patches` (the crop count). The
tower turns each crop into `(S / patch)^2` patch rows; the projector pools them into
`mm_tokens_per_image` rows (256 in the published models), each replacing one
`<image_soft_token>` of the placeholder (`<start_of_image>`, `<end_of_image>` and the newlines
around them keep their text embeddings).

The text model differs from a plain decoder in two ways the runner must follow:
- token embeddings are scaled by sqrt(hidden) (in the embedding's dtype), image rows are not;
- the tokens of one image attend to each other both ways (a prefix LM: vLLM's
  `is_mm_prefix_lm`, transformers' `token_type_ids` blocks), which the runner passes to the
  paged op as key ends (`runner/mm/spans.py`); sliding-window layers still bound each token's
  keys from below at its own position.
mlx-vlm's own forward does neither of the second, nor the first exactly as transformers does (it
rounds the scale to bfloat16), so the decoder layers are driven here.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_metal.models.layers import FULL_ATTENTION, LayerKind
from vllm_metal.models.multimodal import MultimodalAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("gemma3",)
KIND = "vision_language"
MODALITIES: tuple[str, ...] = ("image",)


class Adapter(MultimodalAdapter):
    modalities = ("image",)
    bidirectional_media = True

    def __init__(self, model: Any, config: dict[str, Any]):
        super().__init__(model, config)
        vision = config.get("vision_config") or {}
        # mlx-vlm builds the tower's final LayerNorm with MLX's default epsilon.
        self.model.vision_tower.vision_model.post_layernorm.eps = float(
            vision.get("layer_norm_eps", 1e-6)
        )
        # Gemma 3 ties its head to the embeddings; mlx-vlm loads the head as a copy of them
        # (a second vocabulary-sized matrix: 2.8 GB in bfloat16 for the 27B model).
        text = config.get("text_config") or {}
        if text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)):
            self.language_model.pop("lm_head", None)

    @property
    def decoder(self) -> Any:
        return self.language_model.model

    def layer_kinds(self) -> list[LayerKind]:
        window = LayerKind(sliding_window=int(self.decoder.window_size))
        return [
            window if layer.self_attn.is_sliding else FULL_ATTENTION
            for layer in self.decoder.layers
        ]

    def embed(self, token_ids: mx.array) -> mx.array:
        embeds = self.decoder.embed_tokens(token_ids)
        scale = mx.array(math.sqrt(self.decoder.config.hidden_size), dtype=embeds.dtype)
        return embeds * scale

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        if modality != "image":
            raise ValueError(f"{self.model_type} encodes images, not {modality}")
        pixels = np.concatenate([item["pixel_values"] for item in items])  # [crops, 3, S, S]
        dtype = self.model.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        patches, _, _ = self.model.vision_tower(
            mx.array(pixels.transpose(0, 2, 3, 1)).astype(dtype)
        )
        rows = self.model.multi_modal_projector(patches)  # [crops, tokens per crop, hidden]
        sizes = np.cumsum([len(item["pixel_values"]) for item in items])[:-1]
        return [part.reshape(-1, part.shape[-1]) for part in mx.split(rows, sizes.tolist())]
