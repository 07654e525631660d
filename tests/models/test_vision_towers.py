"""The vision-language adapters' towers against transformers float32, item by item.

vLLM's Idefics3 processor resizes every tile to the tower's full size, so the engine tests never
see a padded tile; a processor configured without resizing to tile multiples (or another
SmolVLM-family processor) does hand over tiles whose `pixel_attention_mask` is partly False.
There transformers buckets the patch positions over the valid patches only and masks padding
patches out of the tower's attention; the adapter must give the same rows.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from tests.fixtures.vision_oracles import load_hf_idefics3
from vllm_metal.models import load_model


@pytest.fixture(scope="module")
def models(tiny_idefics3_dir):
    config = json.loads((tiny_idefics3_dir / "config.json").read_text())
    adapter = load_model(str(tiny_idefics3_dir), compute_dtype=mx.float32, hf_config=config)
    hf_model, _ = load_hf_idefics3(tiny_idefics3_dir)
    return adapter, hf_model


def _tiles(seed: int, valid: list[tuple[int, int]], size: int = 32) -> dict[str, np.ndarray]:
    """Normalised random tiles, each valid in its top-left `height x width` corner only."""
    rng = np.random.default_rng(seed)
    pixels = rng.uniform(-1, 1, (len(valid), 3, size, size)).astype(np.float32)
    mask = np.zeros((len(valid), size, size), dtype=np.int64)
    for i, (height, width) in enumerate(valid):
        mask[i, :height, :width] = 1
        pixels[i, :, height:, :] = 0.0  # the processor pads with zeros
        pixels[i, :, :, width:] = 0.0
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def _transformers_rows(hf_model, item: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        out = hf_model.model.get_image_features(
            torch.from_numpy(item["pixel_values"])[None],
            torch.from_numpy(item["pixel_attention_mask"])[None],
        )
    rows = getattr(out, "pooler_output", out)
    return rows.reshape(-1, rows.shape[-1]).numpy()


@pytest.mark.parametrize(
    "valid",
    [[(32, 32), (32, 32)], [(32, 20), (12, 32), (32, 32)], [(20, 9)]],
    ids=["unpadded", "padded", "one-corner"],
)
def test_idefics3_tower_matches_transformers_on_padded_tiles(models, valid) -> None:
    adapter, hf_model = models
    item = _tiles(len(valid), valid)
    (ours,) = adapter.embed_multimodal("image", [item])
    expected = _transformers_rows(hf_model, item)
    assert ours.shape == expected.shape
    np.testing.assert_allclose(np.array(ours), expected, rtol=1e-4, atol=1e-4)


def test_items_of_one_batch_are_encoded_as_alone(models) -> None:
    adapter, _ = models
    a = _tiles(1, [(32, 32), (32, 20)])
    b = _tiles(2, [(16, 32)])
    together = adapter.embed_multimodal("image", [a, b])
    alone = [adapter.embed_multimodal("image", [x])[0] for x in (a, b)]
    assert [t.shape for t in together] == [t.shape for t in alone] == [(8, 256), (4, 256)]
    for t, s in zip(together, alone):
        np.testing.assert_allclose(np.array(t), np.array(s), rtol=1e-5, atol=1e-5)


def test_profiling_encodes_as_many_images_as_the_encoder_budget_allows(
    models, tiny_idefics3_dir
) -> None:
    """The towers' memory peak is measured on vLLM's largest dummy image, as many of them as one
    step may encode: a budget eight times larger holds eight times the images."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_metal.backends.mlx.runner.mm.profile import encoder_peak

    adapter, _ = models
    peaks = []
    for budget in (256, 2048):
        config = EngineArgs(
            model=str(tiny_idefics3_dir), max_model_len=512, max_num_batched_tokens=budget
        ).create_engine_config()
        peaks.append(encoder_peak(config, adapter))
    assert 0 < peaks[0]
    assert peaks[1] > 4 * peaks[0]
