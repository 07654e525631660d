"""Qwen3-VL (dense): Qwen2.5-VL's layout of items and M-RoPE placement, with a ViT whose
intermediate blocks also feed the language model (DeepStack), through mlx-vlm's `qwen3_vl`
classes.

The tower returns, besides the rows that replace the image's placeholder embeddings, one set of
rows per `deepstack_visual_indexes` block; after decoder layer `i` the `i`-th set is added to the
hidden states at the image's positions. The encoder cache keeps all of them side by side in one
row per placeholder token (`[rows, hidden * (1 + levels)]`), so a chunk that cuts an image span
gets the matching DeepStack rows with its embedding rows.

A video's placeholder writes each grid step (two frames) as its own run,
``<{seconds:.1f} seconds><|vision_start|>`` + `h*w / 4` `<|video_pad|>` + ``<|vision_end|>``,
and only the `<|video_pad|>` tokens take rows (`is_embed`). Time is told by that text, not by
the temporal stream: each run is placed as a one-step grid, like an image (transformers'
`Qwen3VLModel.get_rope_index` splits `video_grid_thw` into `t` grids of one step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

from vllm_metal.models.families import qwen2_5_vl
from vllm_metal.models.families.qwen2_5_vl import Grid
from vllm_metal.models.multimodal import TokenRows

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("qwen3_vl",)
KIND = "vision_language"
MODALITIES: tuple[str, ...] = ("image", "video")


class Adapter(qwen2_5_vl.Adapter):
    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
    ) -> mx.array:
        if positions is None:
            raise ValueError(f"{self.model_type} places its tokens with M-RoPE positions")
        decoder = self.decoder
        rotary = decoder.layers[0].self_attn.rotary_emb
        embeddings = None if rotary.fused_apply else rotary(input_embeds, positions)
        hidden = input_embeds.shape[-1]
        deep = dest = None
        if rows is not None and rows.rows.shape[-1] > hidden:
            deep = rows.rows[:, hidden:].reshape(rows.rows.shape[0], -1, hidden)
            dest = mx.array(rows.dest)
        h = input_embeds
        for i, (layer, cache) in enumerate(zip(decoder.layers, caches)):
            h = layer(h, None, cache, positions, embeddings)
            if deep is not None and i < deep.shape[1]:
                h = h.at[dest].add(deep[:, i, None, :].astype(h.dtype))
        return h if decoder.norm is None else decoder.norm(h)

    def _tower(self, pixels: mx.array, grids: mx.array) -> mx.array:
        main, deepstack = self.model.vision_tower(pixels, grids)
        return mx.concatenate([main, *deepstack], axis=-1)

    def _runs(self, modality: str, tensors: Mapping[str, np.ndarray]) -> list[Grid]:
        return timestamped_runs(modality, tensors)


def timestamped_runs(modality: str, tensors: Mapping[str, np.ndarray]) -> list[Grid]:
    """One run per grid step: an image's one, a video's `t` (split by timestamp text)."""
    t, h, w = qwen2_5_vl.grid_of(tensors, modality).tolist()
    return [Grid(1, h, w)] * t
