"""Idefics3 (SmolVLM): a SigLIP-style vision tower, a pixel-shuffle connector and a Llama
language model, through mlx-vlm's `idefics3` classes.

vLLM's processor splits an image into tiles of `max_image_size` plus one downscaled global
image; each tile is one item row of `pixel_values` (`[tiles, 3, H, W]`, normalised) with its
`pixel_attention_mask` (`[tiles, H, W]`, False where the tile is padding). A tile gives
`(H / patch)^2 / scale_factor^2` rows; the placeholder's `is_embed` marks one `<image>` token per
row, between the `<fake_token_around_image>` and row/column tokens, which keep their text
embeddings.

The tower runs here rather than through mlx-vlm's `get_input_embeddings`, to match transformers
on padded tiles (non-square images): patch position ids are bucketed over each tile's valid
patches and padding patches are masked out of the tower's attention.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.models.multimodal import MultimodalAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("idefics3",)
KIND = "vision_language"
MODALITIES: tuple[str, ...] = ("image",)


class Adapter(MultimodalAdapter):
    modalities = ("image",)

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        if modality != "image":
            raise ValueError(f"{self.model_type} encodes images, not {modality}")
        pixels = np.concatenate([item["pixel_values"] for item in items])
        pixel_mask = np.concatenate(
            [item.get("pixel_attention_mask", _full_mask(item["pixel_values"])) for item in items]
        )
        rows = self._encode_tiles(pixels, pixel_mask.astype(bool))  # [tiles, per tile, hidden]
        sizes = np.cumsum([len(item["pixel_values"]) for item in items])[:-1]
        return [part.reshape(-1, part.shape[-1]) for part in mx.split(rows, sizes.tolist())]

    def _encode_tiles(self, pixels: np.ndarray, pixel_mask: np.ndarray) -> mx.array:
        vision = self.model.vision_model
        embeddings = vision.embeddings
        patch = embeddings.patch_size
        tiles, _, height, width = pixels.shape
        grid = pixel_mask[:, : height // patch * patch, : width // patch * patch]
        grid = grid.reshape(tiles, height // patch, patch, width // patch, patch)
        patch_mask = grid.any(axis=(2, 4))  # [tiles, patches_h, patches_w]

        dtype = embeddings.patch_embedding.weight.dtype
        x = embeddings.patch_embedding(mx.array(pixels.transpose(0, 2, 3, 1)).astype(dtype))
        x = x.reshape(tiles, -1, x.shape[-1])
        positions = _position_ids(patch_mask, embeddings.num_patches_per_side)
        x = x + embeddings.position_embedding(mx.array(positions))

        mask = None
        flat = patch_mask.reshape(tiles, -1)
        if not flat.all():  # padding patches are keys nobody attends to
            mask = mx.array(np.where(flat, 0.0, -np.inf)[:, None, None, :]).astype(x.dtype)
        for layer in vision.encoder.layers:
            x = layer(x, mask=mask)
        x = vision.post_layernorm(x)
        return self.model.connector(x)


def _full_mask(pixels: np.ndarray) -> np.ndarray:
    return np.ones((pixels.shape[0], *pixels.shape[2:]), dtype=bool)


def _position_ids(patch_mask: np.ndarray, per_side: int) -> np.ndarray:
    """Each valid patch's index in the tower's `per_side x per_side` position table: its
    fractional row and column within the tile's valid patches, bucketed to the table (as
    transformers' Idefics3 does); padding patches keep position 0."""
    tiles, rows, cols = patch_mask.shape
    boundaries = np.arange(1 / per_side, 1.0, 1 / per_side).astype(np.float32)
    limit = np.float32(1.0 - 1e-6)
    step_h = np.float32(1.0) / patch_mask[:, :, 0].sum(axis=1).astype(np.float32)
    step_w = np.float32(1.0) / patch_mask[:, 0, :].sum(axis=1).astype(np.float32)
    frac_h = np.minimum(np.arange(rows, dtype=np.float32)[None] * step_h[:, None], limit)
    frac_w = np.minimum(np.arange(cols, dtype=np.float32)[None] * step_w[:, None], limit)
    bucket_h = np.searchsorted(boundaries, frac_h, side="right")
    bucket_w = np.searchsorted(boundaries, frac_w, side="right")
    ids = bucket_h[:, :, None] * per_side + bucket_w[:, None, :]
    return np.where(patch_mask, ids, 0).reshape(tiles, -1).astype(np.int32)
