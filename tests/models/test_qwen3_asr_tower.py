"""Qwen3-ASR's audio encoder and projector in MLX (`models/families/qwen3_asr.py`) give
transformers' float32 `get_audio_features` rows for the tiny checkpoint, on random features and
on a real clip's log-mel features from the checkpoint's own processor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers.models.qwen3_asr")


@pytest.fixture(scope="module")
def oracle(tiny_qwen3_asr_dir: Path):
    from transformers import Qwen3ASRForConditionalGeneration

    model = Qwen3ASRForConditionalGeneration.from_pretrained(tiny_qwen3_asr_dir, dtype="float32")
    return model.eval()


@pytest.fixture(scope="module")
def tower(tiny_qwen3_asr_dir: Path):
    import json

    import mlx.core as mx

    from vllm_metal.models.families.qwen3_asr import load_tower

    config = json.loads((tiny_qwen3_asr_dir / "config.json").read_text())
    return load_tower(tiny_qwen3_asr_dir, config, mx.float32)


def _expected(oracle, features: np.ndarray, frames: int) -> np.ndarray:
    """transformers' rows for one clip: its features zero-padded to whole chunks, as the
    processor pads a single clip."""
    import torch

    padded = -(-frames // 100) * 100
    batch = torch.zeros(1, features.shape[0], padded)
    batch[0, :, :frames] = torch.from_numpy(features[:, :frames])
    mask = torch.zeros(1, padded, dtype=torch.long)
    mask[0, :frames] = 1
    with torch.no_grad():
        out = oracle.get_audio_features(batch, mask, return_dict=True)
    return out.pooler_output.numpy()


# 37: one partial chunk; 100: one whole chunk; 230: two windows and a partial chunk;
# 501: four whole chunks in two windows and one frame in a fifth chunk.
@pytest.mark.parametrize("frames", [37, 100, 230, 501])
def test_tower_matches_transformers_on_random_features(oracle, tower, frames: int) -> None:
    import mlx.core as mx

    from vllm_metal.models.families.qwen3_asr import output_length

    features = np.random.default_rng(frames).normal(size=(128, frames)).astype(np.float32)
    expected = _expected(oracle, features, frames)
    got = np.asarray(tower(mx.array(features)))
    assert got.shape == expected.shape == (output_length(frames), 128)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_tower_matches_transformers_on_processor_features(
    tiny_qwen3_asr_dir: Path, oracle, tower
) -> None:
    import mlx.core as mx
    from transformers import AutoProcessor

    from tests.fixtures.tiny_qwen3_asr import audio_clip, transcription_prompt

    processor = AutoProcessor.from_pretrained(tiny_qwen3_asr_dir)
    inputs = processor(
        text=[transcription_prompt()], audio=[audio_clip(3, 3.1)], return_tensors="pt"
    )
    frames = int(inputs["input_features_mask"].sum())
    features = inputs["input_features"][0].numpy()
    expected = _expected(oracle, features, frames)
    got = np.asarray(tower(mx.array(features[:, :frames])))
    # One placeholder token per row, as the processor expanded the prompt.
    assert got.shape[0] == int((inputs["input_ids"] == processor.audio_token_id).sum())
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
