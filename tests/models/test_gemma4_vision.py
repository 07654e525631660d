"""Gemma 4's image rows on MLX (`families/gemma4_vision.encode_items`, driving mlx-vlm's tower)
are the rows transformers float32 merges at the image placeholders, for the tiny checkpoint of
`tests/fixtures/tiny_gemma4_vl.py` and images of different sizes and aspect ratios, fed as vLLM's
Gemma 4 processor feeds them (one item per image: its padded patches and their positions, from
transformers' own Gemma 4 image processor); a video's rows are its frames' rows.

Below vLLM's front end: vLLM's Gemma 4 processor imports transformers' `Gemma4Processor`, which
needs torchvision."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.tiny_gemma4_vl import (
    BOI_TOKEN_ID,
    EOI_TOKEN_ID,
    IMAGE_TOKEN_ID,
)
from tests.fixtures.tiny_idefics3 import tiny_image

TOLERANCE = 1e-4
# (width, height): a wide and a tall image, upscaled by the processor to grids of 10 x 26 and
# 22 x 12 patches (65 and 66 soft tokens).
IMAGE_SIZES = ((64, 24), (20, 36))


@pytest.fixture(scope="module")
def checkpoint(tiny_gemma4_vl_dir: Path) -> Path:
    return tiny_gemma4_vl_dir


@pytest.fixture(scope="module")
def image_processor(checkpoint: Path) -> Any:
    """transformers' Gemma 4 image processor, as the checkpoint configures it (the PIL one where
    the torchvision one cannot import; they give the same tensors)."""
    try:
        from transformers.models.gemma4.image_processing_gemma4 import (
            Gemma4ImageProcessor as processor_class,
        )
    except ImportError:
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            Gemma4ImageProcessorPil as processor_class,
        )
    return processor_class.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> Any:
    import torch
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mlx_model(checkpoint: Path) -> Any:
    import mlx.core as mx

    from vllm_metal.models.loaders.mlx_vlm import load

    model, _ = load(str(checkpoint), mx.float32)
    return model


def _processed(image_processor: Any, images: list[Any]) -> dict[str, np.ndarray]:
    out = image_processor(images, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def _merged_image_rows(hf_model: Any, input_ids: list[int], processed: dict) -> np.ndarray:
    """The rows transformers' language model receives at the prompt's image tokens."""
    import torch

    captured: dict[str, Any] = {}

    def capture(module: Any, args: tuple, kwargs: dict) -> None:
        captured["inputs_embeds"] = kwargs["inputs_embeds"]

    ids = torch.tensor([input_ids])
    handle = hf_model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.no_grad():
            hf_model.model(
                input_ids=ids,
                pixel_values=torch.from_numpy(processed["pixel_values"]),
                image_position_ids=torch.from_numpy(processed["image_position_ids"]),
            )
    finally:
        handle.remove()
    return captured["inputs_embeds"][0][ids[0] == IMAGE_TOKEN_ID].numpy()


def test_image_rows_match_transformers(image_processor, hf_model, mlx_model):
    from vllm_metal.models.families.gemma4_vision import encode_items

    images = [tiny_image(seed, size) for seed, size in enumerate(IMAGE_SIZES)]
    processed = _processed(image_processor, images)
    counts = processed["num_soft_tokens_per_image"].tolist()
    assert counts == [65, 66]
    # The prompt as vLLM lays it out: each image is <|image>, its soft tokens, <image|>.
    input_ids = [1, 40, 41]
    for count in counts:
        input_ids += [BOI_TOKEN_ID] + [IMAGE_TOKEN_ID] * count + [EOI_TOKEN_ID] + [42]
    expected = _merged_image_rows(hf_model, input_ids, processed)

    # vLLM's items: one per image, its padded patches and their positions.
    items = [
        {
            "pixel_values": processed["pixel_values"][i],
            "pixel_position_ids": processed["image_position_ids"][i],
        }
        for i in range(len(images))
    ]
    rows = [np.asarray(r) for r in encode_items(mlx_model, "image", items)]

    assert [r.shape for r in rows] == [(n, hf_model.config.text_config.hidden_size) for n in counts]
    got = np.concatenate(rows)
    assert np.abs(expected).max() > 1.0  # rows of substance, not a vanishing comparison
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOLERANCE)


def test_video_rows_are_its_frames_rows(image_processor, hf_model, mlx_model):
    import torch

    from vllm_metal.models.families.gemma4_vision import encode_items

    frames = [tiny_image(seed, (48, 32)) for seed in (7, 8)]
    processed = _processed(image_processor, frames)
    pixels = processed["pixel_values"]
    positions = processed["image_position_ids"]
    with torch.no_grad():
        (expected,) = hf_model.model.get_video_features(
            torch.from_numpy(pixels),
            torch.from_numpy(positions),
            num_frames_per_video=torch.tensor([len(frames)]),
        ).pooler_output
    item = {"pixel_values_videos": pixels, "pixel_position_ids_videos": positions}
    (rows,) = encode_items(mlx_model, "video", [item])

    assert rows.shape == tuple(expected.shape)
    assert rows.shape[0] == processed["num_soft_tokens_per_image"].sum()
    np.testing.assert_allclose(np.asarray(rows), expected.numpy(), rtol=0, atol=TOLERANCE)


def test_refuses_other_modalities(mlx_model):
    from vllm_metal.models.families.gemma4_vision import encode_items

    with pytest.raises(ValueError, match="not audio"):
        encode_items(mlx_model, "audio", [])
