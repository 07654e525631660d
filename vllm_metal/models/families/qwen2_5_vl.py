"""Qwen2.5-VL: a windowed ViT with 2x2 patch merging and a Qwen2 language model placed with
M-RoPE, through mlx-vlm's `qwen2_5_vl` classes.

vLLM's processor gives each image `pixel_values` as flat patches (`[t*h*w, 3 * 2 * 14 * 14]`,
already normalised) and `image_grid_thw` (`[3]`: frames, patch rows, patch columns); the image's
placeholder is `t*h*w / 4` `<|image_pad|>` tokens between `<|vision_start|>` and
`<|vision_end|>`, each taking one row of the tower's output. A video is laid out the same way
(`pixel_values_videos`, `video_grid_thw`, `<|video_pad|>`): each grid step holds two frames (the
patch embedding's temporal size), so `t` is half the frame count, and the tower attends within
each step's patches. vLLM also gives a video's `second_per_grid_ts`, the seconds one grid step
spans.

The language model's rotary embedding takes three position streams (`mrope_positions`): text
tokens advance all three together; an image's or video's tokens count grid steps, rows and
columns from the position the text reached, where a video's step `k` sits at
`int(k * second_per_grid_ts * tokens_per_second)` on the temporal stream (an image's one step at
0); the text after it continues one past the largest position used. Later tokens sit at their
index plus a fixed offset on all three streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from vllm_metal.models.multimodal import MultimodalAdapter, TokenRows

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("qwen2_5_vl",)
KIND = "vision_language"
MODALITIES: tuple[str, ...] = ("image", "video")

# The processor's fields of an item, by modality: its patches and its grid.
_FIELDS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}


class Grid(NamedTuple):
    """One run of placeholder tokens: its grid of patches and the temporal stream's step."""

    t: int
    h: int
    w: int
    interval: float = 1.0


class Adapter(MultimodalAdapter):
    modalities = ("image", "video")
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
        tower = self.model.vision_tower
        merge = self.model.config.vision_config.spatial_merge_size
        return encode_items(self._tower, tower, merge, self.model_type, modality, items)

    def _tower(self, pixels: mx.array, grids: mx.array) -> mx.array:
        """The tower's rows of a batch of items (their patches concatenated)."""
        return self.model.vision_tower(pixels, grids, output_hidden_states=False)

    def mrope_positions(
        self, prompt_token_ids: list[int], items: list[tuple[str, dict[str, np.ndarray]]]
    ) -> tuple[np.ndarray, int]:
        config = self.model.config
        runs: dict[int, list[Grid]] = {config.image_token_id: [], config.video_token_id: []}
        for modality, tensors in items:
            token = config.image_token_id if modality == "image" else config.video_token_id
            runs[token].extend(self._runs(modality, tensors))
        return place_tokens(prompt_token_ids, runs, config.vision_config.spatial_merge_size)

    def _runs(self, modality: str, tensors: Mapping[str, np.ndarray]) -> list[Grid]:
        """The runs of placeholder tokens one item fills, in prompt order: one per item here."""
        t, h, w = grid_of(tensors, modality).tolist()
        if modality != "video":
            return [Grid(t, h, w)]
        seconds = tensors.get("second_per_grid_ts")
        seconds = 1.0 if seconds is None else float(np.asarray(seconds).reshape(-1)[0])
        per_second = getattr(self.model.config.vision_config, "tokens_per_second", 1.0)
        return [Grid(t, h, w, seconds * per_second)]


def encode_items(
    encode: Callable[[mx.array, mx.array], mx.array],
    tower: Any,
    merge: int,
    model_type: str,
    modality: str,
    items: list[dict[str, np.ndarray]],
) -> list[mx.array]:
    """Each item's rows: `encode(pixels, grids)` over the items' patches concatenated (in the
    dtype of `tower`'s patch embedding), split per item (`t*h*w / merge**2` rows each)."""
    if modality not in _FIELDS:
        raise ValueError(f"{model_type} encodes {sorted(_FIELDS)}, not {modality}")
    pixels = np.concatenate([item[_FIELDS[modality][0]] for item in items])
    grids = np.stack([grid_of(item, modality) for item in items])
    dtype = tower.patch_embed.proj.weight.dtype
    rows = encode(mx.array(pixels).astype(dtype), mx.array(grids))
    sizes = np.cumsum(grids.prod(axis=1) // merge**2)[:-1]
    return mx.split(rows, sizes.tolist())


def grid_of(tensors: Mapping[str, np.ndarray], modality: str) -> np.ndarray:
    """An item's `[t, h, w]` grid of patches."""
    return np.asarray(tensors[_FIELDS[modality][1]]).reshape(3)


def place_tokens(
    tokens: Sequence[int], runs: Mapping[int, list[Grid]], merge: int
) -> tuple[np.ndarray, int]:
    """M-RoPE positions (`[3, L]` int32) of a prompt and the offset of later tokens. `runs` maps
    each placeholder token id to the grids of its runs (maximal runs of that token) in prompt
    order; every other token is text.

    A grid's block starts on all three streams where the text reached; the text after it starts
    one past the block's largest position, the temporal stream included (vLLM's
    `get_mrope_input_positions` and Qwen's original `get_rope_index`; transformers 5 continues
    from the largest row or column instead, which differs only for a video whose temporal span
    exceeds its rows and columns)."""
    ids = np.asarray(tokens, dtype=np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    queues: dict[int, Iterator[Grid]] = {token: iter(grids) for token, grids in runs.items()}
    kind = np.where(np.isin(ids, list(runs)), ids, -1)  # -1: text
    bounds = np.flatnonzero(np.diff(kind) != 0) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    ends = np.concatenate([bounds, [len(ids)]]).astype(np.int64)
    at = 0  # the next text position
    for start, end in zip(starts.tolist(), ends.tolist()):
        if start == end:  # an empty prompt
            continue
        if kind[start] < 0:
            out[:, start:end] = np.arange(end - start) + at
            at += end - start
            continue
        grid = next(queues[int(ids[start])], None)
        if grid is None:
            raise ValueError(f"token {ids[start]} at {start}: more placeholder runs than items")
        steps = (np.arange(grid.t) * grid.interval).astype(np.int64)
        block = np.stack(
            np.meshgrid(
                steps, np.arange(grid.h // merge), np.arange(grid.w // merge), indexing="ij"
            )
        ).reshape(3, -1)
        if block.shape[1] != end - start:
            raise ValueError(
                f"the placeholder at {start} has {end - start} tokens, its grid "
                f"{(grid.t, grid.h, grid.w)} takes {block.shape[1]}"
            )
        out[:, start:end] = block + at
        at = int(out[:, start:end].max()) + 1
    for token, queue in queues.items():
        if next(queue, None) is not None:
            raise ValueError(f"fewer runs of token {token} in the prompt than items")
    delta = (int(out.max()) + 1 - len(ids)) if len(ids) else 0
    return out.astype(np.int32), delta
