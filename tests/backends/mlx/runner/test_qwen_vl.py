"""Qwen2.5-VL and Qwen3-VL with images on the runner's multimodal path: the encoder cache, the
M-RoPE positions, DeepStack rows (Qwen3-VL) and the packed paged forward, driven step by step as
vLLM's scheduler drives them (prefill in chunks that may cut an image span, then one token per
step), against transformers float32.

The engine is not involved: each image item is built as `qwen_vl_steps` describes (vLLM's own
`MultiModalKwargsItems.from_hf_inputs` over the checkpoint's image processor outputs); the
placeholder is the run of `<|image_pad|>` tokens. The macOS job runs the same models through
`vllm serve`.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.backends.mlx.runner.qwen_vl_steps import (
    FIXTURES,
    NEW_TOKENS,
    cached_request,
    greedy,
    load_family,
)
from tests.fixtures import vision_oracles
from tests.fixtures.tiny_idefics3 import tiny_image

ONE_IMAGE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
TWO_IMAGES = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
    "<|vision_start|><|image_pad|><|vision_end|>Same?<|im_end|>\n"
)
TEXT_ONLY = "<|im_start|>user\nWhat is it?<|im_end|>\n"
# family -> square, wide and tall image sizes: 4, 8 and 8 image tokens
SIZES = {
    "qwen2_5_vl": ((56, 56), (112, 56), (56, 112)),
    "qwen3_vl": ((64, 64), (128, 64), (64, 128)),
}
# case -> (prompt, images as (seed, size index into the family's sizes))
CASES = {
    "one-image": (ONE_IMAGE, [(0, 0)]),
    "other-image": (ONE_IMAGE, [(1, 0)]),
    "wide-image": (ONE_IMAGE, [(2, 1)]),
    "two-images": (TWO_IMAGES, [(3, 0), (4, 2)]),
    "text-only": (TEXT_ONLY, []),
}


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def family(request) -> SimpleNamespace:
    """(family, checkpoint directory, config, adapter, image sizes) of each Qwen-VL family."""
    loaded = load_family(request, request.param)
    loaded.sizes = SIZES[request.param]
    return loaded


def _pictures(family, images) -> list:
    return [tiny_image(seed, family.sizes[size]) for seed, size in images]


def _request(family, prompt: str, images: list):
    """vLLM's view of the prompt: its token ids and one `MultiModalFeatureSpec` per image."""
    inputs = getattr(vision_oracles, f"{family.name}_inputs")(
        family.dir, prompt, _pictures(family, images)
    )
    return cached_request(family, inputs, {"image": [f"image-{image}" for image in images]})


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [512, 5], ids=["whole-prompt", "chunks-of-5"])
def test_greedy_tokens_match_transformers(family, case, chunk) -> None:
    prompt, images = CASES[case]
    state = _request(family, prompt, images)
    pictures = _pictures(family, images)
    expected = getattr(vision_oracles, f"{family.name}_generate")(
        family.dir, prompt, pictures, NEW_TOKENS
    )
    expected_logits = getattr(vision_oracles, f"{family.name}_logits")(family.dir, prompt, pictures)
    tokens, logits = greedy(family.adapter, state, chunk)
    assert tokens == expected
    np.testing.assert_allclose(logits, np.asarray(expected_logits)[-1], rtol=1e-4, atol=1e-4)


def test_text_after_an_image_continues_from_its_largest_position(family):
    """The image's tokens share one temporal position and count rows and columns on the other
    two streams; the text after it starts one past the largest, so later tokens sit below their
    index (the offset is negative)."""
    state = _request(family, *CASES["wide-image"])
    (feature,) = state.mm_features
    items = [("image", {"image_grid_thw": np.asarray(feature.data.get_data()["image_grid_thw"])})]
    table, delta = family.adapter.mrope_positions(list(state.prompt_token_ids), items)
    start, length = feature.mm_position.offset, feature.mm_position.length
    image = table[:, start : start + length]
    _, h, w = feature.data.get_data()["image_grid_thw"].tolist()
    assert (image[0] == start).all()
    assert sorted(set(image[1].tolist())) == list(range(start, start + h // 2))
    assert sorted(set(image[2].tolist())) == list(range(start, start + w // 2))
    after = table[:, start + length]
    assert (after == start + max(h, w) // 2).all()
    assert delta == int(table.max()) + 1 - len(state.prompt_token_ids) < 0
