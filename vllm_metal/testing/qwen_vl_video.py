"""Videos for the Qwen-VL oracles (`vision_oracles.qwen2_5_vl_inputs`, `vision_oracles.qwen3_vl_inputs`):
the tensors and the prompt text the Qwen-VL video processors and processors make, built without
them (both video processors need torchvision, which must stay absent here).

The video processor resizes every frame alike and cuts it into the image processor's patches,
with the frames taken `temporal_patch_size` (2) at a time: grid step `k` holds frames `2k` and
`2k + 1`, and each patch row holds ``[channel, frame of the step, 14x14 or 16x16 pixels]``. The
image processor gives a single frame the same rows with the frame repeated in both temporal
slots, so a video's rows are the image processor's rows of each frame with the first temporal
slot of the step's frames put side by side (`video_patches`). Rows are in grid-step order, each
step's rows in the image processor's order (2x2 merge blocks), so `video_grid_thw` is
``[frames / 2, h, w]``.

Qwen2.5-VL's processor also gives ``second_per_grid_ts`` (``temporal_patch_size / fps``) and
expands `<|video_pad|>` to ``t*h*w / 4`` of itself. Qwen3-VL's (transformers 5) expands the bare
`<|video_pad|>` to one run per grid step, ``<{seconds:.1f} seconds><|vision_start|>`` and
``h*w / 4`` `<|video_pad|>` and ``<|vision_end|>``, where the seconds are the mean time of the
step's two frames (frame `i` at ``i / fps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

VIDEO_PAD = "<|video_pad|>"


@dataclass(frozen=True)
class Video:
    """Sampled frames (PIL images of one size, an even number of them) and their rate."""

    frames: tuple[Any, ...]
    fps: float


def video_patches(image_processor: Any, frames: tuple[Any, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The video processor's ``pixel_values_videos`` rows (float32) and ``video_grid_thw`` of
    one video, from the image processor's rows of each frame."""
    step = image_processor.temporal_patch_size
    if len(frames) % step:
        raise ValueError(f"{len(frames)} frames: the count must be a multiple of {step}")
    rows, grids = [], []
    for frame in frames:
        out = image_processor(images=[frame], return_tensors="np")
        grid = np.asarray(out["image_grid_thw"]).reshape(3)
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        # [patches, channel, temporal slot, pixels]: both slots hold this frame.
        rows.append(pixels.reshape(pixels.shape[0], 3, step, -1)[:, :, 0])
        grids.append(grid)
    if any((g != grids[0]).any() for g in grids):
        raise ValueError(f"the frames resize to different grids: {[g.tolist() for g in grids]}")
    steps = [np.stack(rows[i : i + step], axis=2) for i in range(0, len(rows), step)]
    pixels = np.concatenate(steps).reshape(len(steps) * rows[0].shape[0], -1)
    _, h, w = grids[0].tolist()
    return pixels, np.array([len(steps), h, w], dtype=np.int64)


def step_seconds(video: Video, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's timestamp of each grid step: the mean time of its frames."""
    times = [i / video.fps for i in range(len(video.frames))]
    step = temporal_patch_size
    return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


def video_placeholder(family: str, video: Video, grid: np.ndarray, image_processor: Any) -> str:
    """The text `<|video_pad|>` becomes for one video."""
    t, h, w = grid.tolist()
    per_step = h * w // image_processor.merge_size**2
    if family == "qwen2_5_vl":
        return VIDEO_PAD * (t * per_step)
    seconds = step_seconds(video, image_processor.temporal_patch_size)
    return "".join(
        f"<{s:.1f} seconds><|vision_start|>{VIDEO_PAD * per_step}<|vision_end|>" for s in seconds
    )


def video_fields(
    family: str, videos: list[Video], image_processor: Any
) -> tuple[dict[str, Any], list[str]]:
    """The processor's video tensors of a prompt (torch) and each video's placeholder text."""
    import torch

    patches = [video_patches(image_processor, video.frames) for video in videos]
    fields: dict[str, Any] = {
        "pixel_values_videos": torch.from_numpy(np.concatenate([p for p, _ in patches])),
        "video_grid_thw": torch.from_numpy(np.stack([g for _, g in patches])),
    }
    if family == "qwen2_5_vl":
        step = image_processor.temporal_patch_size
        fields["second_per_grid_ts"] = torch.tensor([step / v.fps for v in videos])
    texts = [
        video_placeholder(family, video, grid, image_processor)
        for video, (_, grid) in zip(videos, patches)
    ]
    return fields, texts
