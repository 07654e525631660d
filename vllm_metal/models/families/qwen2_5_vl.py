"""Qwen2.5-VL: a windowed ViT with 2x2 patch merging and a Qwen2 language model placed with
M-RoPE, through mlx-vlm's `qwen2_5_vl` classes.

vLLM's processor gives each image `pixel_values` as flat patches (`[t*h*w, 3 * 2 * 14 * 14]`,
already normalised) and `image_grid_thw` (`[3]`: frames, patch rows, patch columns); the image's
placeholder is `t*h*w / 4` `<|image_pad|>` tokens between `<|vision_start|>` and
`<|vision_end|>`, each taking one row of the tower's output. The language model's rotary
embedding takes three position streams: text tokens advance all three together, an image's
tokens share the temporal position and count rows and columns on the other two, and the text
after an image continues from the largest position used (`mrope_positions`, mlx-vlm's
`get_rope_index`, which follows transformers). Later tokens sit at their index plus a fixed
offset on all three streams.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from vllm_metal.models.multimodal import MultimodalAdapter, TokenRows

# The processor's fields of an item, by modality: its patches and its grid.
_FIELDS = {"image": ("pixel_values", "image_grid_thw")}


class Adapter(MultimodalAdapter):
    modalities = ("image",)
    uses_mrope = True

    @property
    def decoder(self) -> Any:
        return self.language_model.model

    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
    ) -> mx.array:
        if positions is None:
            raise ValueError(f"{self.model_type} places its tokens with M-RoPE positions")
        return self.decoder(None, inputs_embeds=input_embeds, cache=caches, position_ids=positions)

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        if modality not in _FIELDS:
            raise ValueError(f"{self.model_type} encodes {sorted(_FIELDS)}, not {modality}")
        pixels_key, grid_key = _FIELDS[modality]
        pixels = np.concatenate([item[pixels_key] for item in items])
        grids = np.stack([np.asarray(item[grid_key]).reshape(3) for item in items])
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        rows = self._tower(mx.array(pixels).astype(dtype), mx.array(grids))
        merge = self.model.config.vision_config.spatial_merge_size
        sizes = np.cumsum(grids.prod(axis=1) // merge**2)[:-1]
        return mx.split(rows, sizes.tolist())

    def _tower(self, pixels: mx.array, grids: mx.array) -> mx.array:
        """The tower's rows of a batch of items (their patches concatenated)."""
        return self.model.vision_tower(pixels, grids, output_hidden_states=False)

    def mrope_positions(
        self, prompt_token_ids: list[int], items: list[tuple[str, dict[str, np.ndarray]]]
    ) -> tuple[np.ndarray, int]:
        grids = [np.asarray(t[_FIELDS["image"][1]]).reshape(3) for m, t in items if m == "image"]
        image_grid = mx.array(np.stack(grids)) if grids else None
        positions, delta = self.language_model.get_rope_index(
            mx.array([list(prompt_token_ids)]), image_grid, None, None
        )
        positions = np.array(positions).astype(np.int32)
        if positions.ndim == 2:  # a prompt without images: one stream, [1, L]
            return np.repeat(positions, 3, axis=0), 0
        return positions[:, 0, :], int(np.array(delta).reshape(-1)[0])
