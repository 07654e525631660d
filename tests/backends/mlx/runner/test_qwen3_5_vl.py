"""Qwen3.5 (a Gated DeltaNet hybrid) with images and video on the runner's multimodal path: mlx-vlm's tower,
the encoder cache, interleaved M-RoPE on the full-attention layers and the state layers on their
pages, driven step by step as vLLM's scheduler drives them (whole prompts and chunks that cut an
image span), against transformers float32 `Qwen3_5ForConditionalGeneration`.

The engine is not involved (vLLM's Qwen3.5 processor imports torchvision, which does not load
here): each item is laid out as vLLM's Qwen3-VL processor lays it out
(`qwen_vl_steps.cached_request`), from transformers' image processor outputs (a video's frames
as `tests.fixtures.qwen_vl_video` lays them out: 4 frames, 2 grid steps, one timestamped run
each).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from tests.backends.mlx.runner.media_steps import run_greedy
from tests.backends.mlx.runner.qwen_vl_steps import NEW_TOKENS, cached_request
from tests.fixtures import qwen3_5_vl_oracle as oracle
from tests.fixtures.qwen_vl_video import Video
from tests.fixtures.tiny_idefics3 import tiny_image

# A block's K and V (1 KV head of 64, float32: 512 bytes a token) must hold a state page.
BLOCK_SIZE = 256
TEXT = [30, 41, 52, 63, 74]
IMAGE, VIDEO = [14, 12, 15], [14, 13, 15]  # <|vision_start|><|image_pad|><|vision_end|>, ...
# case -> (prompt with one image or video token per item, images as (seed, (width, height)),
# videos as (seed, (width, height)) of 4 frames at 2 fps)
CASES = {
    "one-image": ([*TEXT, *IMAGE, 33, 44, 55], [(0, (64, 64))], []),
    "wide-image": ([*TEXT, *IMAGE, 33, 44], [(2, (128, 64))], []),
    "two-images": ([20, *IMAGE, 21, *IMAGE, 22, 23], [(3, (64, 64)), (4, (64, 128))], []),
    "text-only": ([*TEXT, 33, 44, 55], [], []),
}
FULL_CASES = {
    "one-video": ([*TEXT, *VIDEO, 33, 44], [], [(5, (128, 64))]),
    "image-then-video": ([20, *IMAGE, 21, *VIDEO, 22], [(6, (64, 64))], [(7, (64, 64))]),
}


def _video(seed: int, size: tuple[int, int]) -> Video:
    return Video(tuple(tiny_image(seed * 10 + k, size) for k in range(4)), fps=2.0)


@pytest.fixture(scope="module")
def family(tiny_qwen3_5_dir) -> SimpleNamespace:
    from vllm_metal.models import load_model

    config = json.loads((tiny_qwen3_5_dir / "config.json").read_text())
    adapter = load_model(
        str(tiny_qwen3_5_dir), compute_dtype=mx.float32, hf_config=config, towers=True
    )
    return SimpleNamespace(name="qwen3_5", dir=tiny_qwen3_5_dir, config=config, adapter=adapter)


def _check(family, case: tuple, chunk: int) -> None:
    prompt, images, videos = case
    pictures = [tiny_image(seed, size) for seed, size in images]
    clips = [_video(seed, size) for seed, size in videos]
    inputs = oracle.qwen3_5_inputs(family.dir, prompt, pictures, clips)
    names = {"image": [f"image-{i}" for i in range(len(images))]}
    names["video"] = [f"video-{i}" for i in range(len(videos))]
    state = cached_request(family, inputs, names)
    expected, expected_logits = oracle.qwen3_5_generate(
        family.dir, prompt, pictures, NEW_TOKENS, clips
    )
    tokens, logits = run_greedy(
        family.adapter, {"r": state}, chunk=chunk, new_tokens=NEW_TOKENS, block_size=BLOCK_SIZE
    )["r"]
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_transformers(family, case) -> None:
    """Prefill in chunks of 5 tokens, which cut every image span, then decode."""
    _check(family, CASES[case], 5)


@pytest.mark.full
@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_prompts_match_transformers(family, case) -> None:
    _check(family, CASES[case], 512)


@pytest.mark.full
@pytest.mark.parametrize("case", sorted(FULL_CASES))
@pytest.mark.parametrize("chunk", [512, 7], ids=["whole-prompt", "chunks-of-7"])
def test_video_greedy_tokens_match_transformers(family, case, chunk) -> None:
    _check(family, FULL_CASES[case], chunk)


@pytest.mark.full
@pytest.mark.parametrize("case", ["two-images", "image-then-video"])
def test_moe_wrapper_matches_transformers(tiny_qwen3_5_moe_dir, case) -> None:
    """The MoE wrapper (`Qwen3_5MoeForConditionalGeneration`) through the same code."""
    from vllm_metal.models import load_model

    config = json.loads((tiny_qwen3_5_moe_dir / "config.json").read_text())
    adapter = load_model(
        str(tiny_qwen3_5_moe_dir), compute_dtype=mx.float32, hf_config=config, towers=True
    )
    family = SimpleNamespace(
        name="qwen3_5", dir=tiny_qwen3_5_moe_dir, config=config, adapter=adapter
    )
    _check(family, {**CASES, **FULL_CASES}[case], 5)
