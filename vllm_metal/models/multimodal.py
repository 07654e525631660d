"""The runner's view of a vision-language model from mlx-vlm: a paged language model, plus
towers that turn media items into rows of input embeddings.

mlx-vlm's `Model` holds `language_model` (embeddings, decoder layers, final norm and head) and the
vision tower and projector under family-specific names. The language model takes the runner's
paged caches as an mlx-lm model does (attention routed through `scaled_dot_product_attention`);
each family (`families/<model_type>.py`) says how its tower maps the processor's tensors of one
item (`pixel_values`, ...) to the rows that replace the item's placeholder tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.models.adapter import ModelAdapter


@dataclass
class TokenRows:
    """Encoder rows of one step's packed tokens: `rows[i]` belongs to packed token `dest[i]`.
    The first `hidden` columns replace the token's input embedding; a family whose tower feeds
    later decoder layers too (DeepStack) carries those rows in the further columns."""

    dest: np.ndarray  # [N] int32 packed token indices
    rows: mx.array  # [N, hidden * (1 + levels)]


class MultimodalAdapter(ModelAdapter):
    # The modalities the model's towers encode (vLLM's names: "image", "video", "audio").
    modalities: tuple[str, ...] = ("image",)
    # uses_mrope: the language model places tokens with M-RoPE, three position streams (time,
    # height, width) per token instead of one, from `mrope_positions`.
    # The tokens of one media item attend to each other both ways (a prefix LM: vLLM's
    # `is_mm_prefix_lm`), not only causally; with `bidirectional_sliding_only`, only in the
    # sliding-window layers (Gemma 4), the full-attention ones staying causal.
    bidirectional_media = False
    bidirectional_sliding_only = False

    @property
    def language_model(self) -> Any:
        return self.model.language_model

    @property
    def decoder(self) -> Any:
        """Embeddings, decoder layers and final norm of the language model."""
        return self.language_model

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    def install_paged_attention(self) -> None:
        attention.route_module_sdpa(self.language_model)

    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
    ) -> mx.array:
        """Hidden states after the final norm, from input embeddings with the step's encoder
        rows already merged; `positions` (`[3, T, 1]`) for M-RoPE models, `rows` for families
        whose towers feed later layers too."""
        h = input_embeds
        for layer, cache in zip(self.decoder.layers, caches):
            h = layer(h, None, cache)
        return self.decoder.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        head = getattr(self.language_model, "lm_head", None)
        if head is None:  # tied embeddings
            return self.decoder.embed_tokens.as_linear(hidden)
        return head(hidden)

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        """One `[rows, hidden]` array per item (`[rows, hidden * (1 + levels)]` with DeepStack):
        the embeddings its placeholder's `is_embed` positions take, in order. `items` are the
        processor's tensors of each item."""
        raise NotImplementedError

    def mrope_positions(
        self, prompt_token_ids: list[int], items: list[tuple[str, dict[str, np.ndarray]]]
    ) -> tuple[np.ndarray, int]:
        """For M-RoPE models: the three position streams of the prompt's tokens (`[3, L]`) and
        the offset of every later token (its position is its index plus the offset, on all three
        streams). `items`: (modality, tensors) of the prompt's media items in prompt order; only
        their grid fields (`image_grid_thw`, `video_grid_thw`, ...) and a video's timing
        (Qwen2.5-VL's `second_per_grid_ts`) are read, which vLLM keeps for every item."""
        raise NotImplementedError
