"""Qwen3.5 (a Gated DeltaNet hybrid) with images on the runner's multimodal path: mlx-vlm's tower,
the encoder cache, interleaved M-RoPE on the full-attention layers and the state layers on their
pages, driven step by step as vLLM's scheduler drives them (whole prompts and chunks that cut an
image span), against transformers float32 `Qwen3_5ForConditionalGeneration`.

The engine is not involved (vLLM's Qwen3.5 processor imports torchvision, which does not load
here): each image item is laid out as vLLM's Qwen3-VL processor lays it out
(`qwen_vl_steps.cached_request`), from transformers' image processor outputs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from tests.backends.mlx.runner.media_steps import run_greedy
from tests.backends.mlx.runner.qwen_vl_steps import NEW_TOKENS, cached_request
from tests.fixtures import vision_oracles
from tests.fixtures.tiny_idefics3 import tiny_image

# A block's K and V (1 KV head of 64, float32: 512 bytes a token) must hold a state page.
BLOCK_SIZE = 256
TEXT = [30, 41, 52, 63, 74]
# case -> (prompt with one image token per image, images as (seed, (width, height)))
CASES = {
    "one-image": ([*TEXT, 14, 12, 15, 33, 44, 55], [(0, (64, 64))]),
    "wide-image": ([*TEXT, 14, 12, 15, 33, 44], [(2, (128, 64))]),
    "two-images": ([20, 14, 12, 15, 21, 14, 12, 15, 22, 23], [(3, (64, 64)), (4, (64, 128))]),
    "text-only": ([*TEXT, 33, 44, 55], []),
}


@pytest.fixture(scope="module")
def family(tiny_qwen3_5_dir) -> SimpleNamespace:
    from vllm_metal.models import load_model

    config = json.loads((tiny_qwen3_5_dir / "config.json").read_text())
    adapter = load_model(
        str(tiny_qwen3_5_dir), compute_dtype=mx.float32, hf_config=config, towers=True
    )
    return SimpleNamespace(name="qwen3_5", dir=tiny_qwen3_5_dir, config=config, adapter=adapter)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [512, 5], ids=["whole-prompt", "chunks-of-5"])
def test_greedy_tokens_match_transformers(family, case, chunk) -> None:
    prompt, images = CASES[case]
    pictures = [tiny_image(seed, size) for seed, size in images]
    inputs = vision_oracles.qwen3_5_inputs(family.dir, prompt, pictures)
    state = cached_request(family, inputs, {"image": [f"image-{i}" for i in range(len(images))]})
    expected, expected_logits = vision_oracles.qwen3_5_generate(
        family.dir, prompt, pictures, NEW_TOKENS
    )
    tokens, logits = run_greedy(
        family.adapter, {"r": state}, chunk=chunk, new_tokens=NEW_TOKENS, block_size=BLOCK_SIZE
    )["r"]
    assert tokens == expected
    np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)
