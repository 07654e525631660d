"""Gemma 4's vision tower, for `families/gemma4_vl.py` (the Gemma 4 wrapper's adapter, which calls
`encode_items` from its `embed_multimodal`). A helper module: it declares no `MODEL_TYPES` and is
not listed in `families.MODULES`.

What vLLM 0.32's Gemma 4 processor (`vllm/model_executor/models/gemma4_mm.py`) hands the model:
- an image item: `pixel_values` `[max_patches, 3 * patch^2]` float32 and `pixel_position_ids`
  `[max_patches, 2]` int64 (transformers' `image_position_ids`, renamed). The image processor
  resizes the image, keeping its aspect ratio, so both sides are multiples of
  `patch * pooling_kernel_size` and it holds at most `max_patches = max_soft_tokens * k^2` patches
  (`max_soft_tokens`: 280 unless asked otherwise, one of 70, 140, 280, 560, 1120; k = 3 in the
  published models), rescales to [0, 1] (no normalisation) and flattens the patches row by row,
  each patch's values in (row, column, channel) order; then pads to `max_patches` rows of zeros
  with positions (-1, -1). A real patch's position is (x, y): its column and row;
- the image's placeholder: `boi_token_id`, then (h/k)(w/k) `image_token_id` (h x w patches), then
  `eoi_token_id`; only the image tokens take encoder rows (`is_embed`);
- a video item: `pixel_values_videos` `[frames, max_patches, 3 * patch^2]` and
  `pixel_position_ids_videos` `[frames, max_patches, 2]`, each frame processed as an image with
  `max_soft_tokens` 70, plus `video_frame_counts`, `video_num_soft_tokens` and
  `video_timestamps`; its placeholder is, per frame, the frame's `mm:ss` timestamp as text, then
  `boi_token_id`, the frame's `video_token_id` tokens and `eoi_token_id`; the item's rows are its
  frames' rows in order.
The module imports transformers' `Gemma4Processor`, which needs torchvision: on a host without
it (the Linux test environment) `gemma4_mm` does not import, so tests drive the tower below
vLLM's front end, with transformers' torch-free `Gemma4ImageProcessorPil`, which gives the same
tensors.

What transformers (`Gemma4Model`, `modeling_gemma4.py`) does with them, and `encode_items` here:
- the tower (`get_image_features`): the patches `2 * (pixels - 0.5)` through `input_proj`, plus a
  learned embedding of x and one of y; bidirectional layers over the real patches (padding masked
  out, so dropping it changes nothing), each with 2-D RoPE on (x, y); the patches averaged in k x k
  blocks (soft token `x // k + (w / k) * (y // k)`), times sqrt(vision hidden) in float32, then
  (`standardize`) minus `std_bias` times `std_scale`; `embed_vision`: a scale-free RMSNorm and a
  projection to the text width;
- merging: text rows are the token embeddings times sqrt(text hidden); an image's rows replace
  its `image_token_id` rows as they are, not scaled;
- per-layer inputs (models with `hidden_size_per_layer_input`): the token-identity part of an
  image (or video, audio) token is looked up for `text_config.pad_token_id` (vLLM and mlx-vlm use
  id 0, the published pad id); the projected part is taken from the merged rows, image rows
  included;
- attention (`use_bidirectional_attention == "vision"`, which is vLLM's `is_mm_prefix_lm`): in
  sliding-window layers a token of a run of consecutive image (or video) tokens also sees the
  later tokens of its run, still bounded below by the window; full-attention layers stay causal
  (Gemma 3 opens every layer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

# The processor's fields of an item, by modality: its patches and their positions.
FIELDS = {
    "image": ("pixel_values", "pixel_position_ids"),
    "video": ("pixel_values_videos", "pixel_position_ids_videos"),
}


def encode_items(
    model: Any, modality: str, items: list[Mapping[str, np.ndarray]]
) -> list[mx.array]:
    """Each item's rows (`[soft tokens, text hidden]`, in the tower's dtype): the rows that replace
    its placeholder tokens, in order. `model` is mlx-vlm's Gemma 4 `Model` (`vision_tower`,
    `embed_vision`); `items` are vLLM's processor items (`FIELDS`)."""
    if modality not in FIELDS:
        raise ValueError(f"gemma4 encodes {sorted(FIELDS)}, not {modality}")
    pixels_field, positions_field = FIELDS[modality]
    frames: list[tuple[np.ndarray, np.ndarray]] = []  # (patches, positions) of each real frame
    counts: list[int] = []  # frames per item
    for item in items:
        pixels = np.asarray(item[pixels_field])
        positions = np.asarray(item[positions_field])
        pixels = pixels.reshape(-1, *pixels.shape[-2:])
        positions = positions.reshape(-1, *positions.shape[-2:])
        counts.append(len(pixels))
        for p, pos in zip(pixels, positions):
            real = (pos != -1).all(axis=-1)
            frames.append((p[real], pos[real]))
    rows = _encode_frames(model, frames)
    out, at = [], 0
    for count in counts:
        out.append(mx.concatenate(rows[at : at + count]) if count != 1 else rows[at])
        at += count
    return out


def _encode_frames(model: Any, frames: list[tuple[np.ndarray, np.ndarray]]) -> list[mx.array]:
    """The rows of each frame (its real patches and their positions), frames of one patch count
    encoded together."""
    rows: list[mx.array | None] = [None] * len(frames)
    by_count: dict[int, list[int]] = {}
    for i, (patches, _) in enumerate(frames):
        by_count.setdefault(len(patches), []).append(i)
    for indices in by_count.values():
        pixels = np.stack([frames[i][0] for i in indices])
        positions = np.stack([frames[i][1] for i in indices]).astype(np.int32)
        encoded = _encode_batch(model, pixels, positions)
        for j, i in enumerate(indices):
            rows[i] = encoded[j]
    return rows  # type: ignore[return-value]


def _encode_batch(model: Any, pixels: np.ndarray, positions: np.ndarray) -> mx.array:
    """`[B, soft tokens, text hidden]` of B frames with the same number of real patches
    (`pixels` `[B, n, 3 * patch^2]`, `positions` `[B, n, 2]`)."""
    tower = model.vision_tower
    k = int(tower.config.pooling_kernel_size)
    embedder = tower.patch_embedder
    dtype = embedder.input_proj.weight.dtype
    width, height = positions[..., 0].max(axis=1) + 1, positions[..., 1].max(axis=1) + 1
    n = pixels.shape[1]
    if np.any(width % k) or np.any(height % k) or np.any(width * height != n):
        raise ValueError(
            f"gemma4: an image's patches must fill a grid whose sides are multiples of the "
            f"pooling kernel ({k}); got {n} patches over grids of "
            f"{list(zip(height.tolist(), width.tolist()))}"
        )
    # Patch embedding: a linear map of the patch values in [-1, 1], plus the learned embeddings
    # of the patch's column and row.
    pos = mx.array(positions)
    table = embedder.position_embedding_table
    h = embedder.input_proj((2 * (mx.array(pixels) - 0.5)).astype(dtype))
    h = h + (table[0][pos[..., 0]] + table[1][pos[..., 1]]).astype(dtype)
    h = tower.encoder(h, pos, None)  # bidirectional, over the real patches only
    # Average pooling of each k x k block of patches into one soft token, in float32.
    tokens = n // (k * k)
    cell = positions[..., 0] // k + (width[:, None] // k) * (positions[..., 1] // k)  # [B, n]
    weights = (cell[:, None, :] == np.arange(tokens)[None, :, None]).astype(np.float32) / (k * k)
    pooled = (mx.array(weights) @ h.astype(mx.float32)).astype(h.dtype)
    pooled = pooled.astype(mx.float32) * math.sqrt(tower.config.hidden_size)
    if tower.config.standardize:
        pooled = (pooled - tower.std_bias.astype(mx.float32)) * tower.std_scale.astype(mx.float32)
    return model.embed_vision(pooled.astype(dtype))
