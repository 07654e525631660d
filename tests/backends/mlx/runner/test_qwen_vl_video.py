"""Qwen2.5-VL and Qwen3-VL with videos on the runner's multimodal path (encoder cache, M-RoPE
positions, DeepStack rows, packed paged forward), driven step by step as vLLM's scheduler drives
them, against transformers float32: greedy tokens, the prompt's logits and the M-RoPE positions.

Items are built as `qwen_vl_steps` describes. The transformers video processors need
torchvision, so `pixel_values_videos` is laid out from the image processor's patches of each
frame (`tests.fixtures.qwen_vl_video`: grid step `k` holds frames `2k` and `2k + 1`, the
video processor's layout), and the prompt expanded as the processors expand it: Qwen2.5-VL's
`<|video_pad|>` to `t*h*w / 4` of itself, Qwen3-VL's to one timestamped
`<|vision_start|>...<|vision_end|>` run per grid step. Every video has 4 frames (a grid of
t = 2 steps). Qwen2.5-VL's `second_per_grid_ts` (2 / fps) is 1.5 or 0.75 here, so with the
checkpoint's 2 tokens per second the second grid step sits 3 or 1 (1.5 truncated) temporal
positions after the first, not the 2 of a video without `second_per_grid_ts` (taken as 1 s).
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
from tests.fixtures.qwen_vl_video import Video
from tests.fixtures.tiny_idefics3 import tiny_image
from vllm_metal.backends.mlx.runner.mm.embeddings import item_tensors

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE_VIDEO = f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n"
IMAGE_THEN_VIDEO = f"<|im_start|>user\n{IMAGE}in{VIDEO}Where?<|im_end|>\n"
VIDEO_THEN_IMAGE = f"<|im_start|>user\n{VIDEO}then{IMAGE}Same?<|im_end|>\n"
# family -> (square frame, wide frame, small image) sizes (width, height). Square frames give
# 4x4 tokens per grid step, wide ones 2x4; the image 2x2.
SIZES = {
    "qwen2_5_vl": ((112, 112), (112, 56), (56, 56)),
    "qwen3_vl": ((128, 128), (128, 64), (64, 64)),
}
# case -> (prompt, images as (seed, size index), videos as (seed, size index, fps))
CASES = {
    "one-video": (ONE_VIDEO, [], [(0, 0, 4 / 3)]),
    "image-then-video": (IMAGE_THEN_VIDEO, [(1, 2)], [(2, 1, 8 / 3)]),
    "video-then-image": (VIDEO_THEN_IMAGE, [(3, 2)], [(4, 0, 4 / 3)]),
}


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def family(request) -> SimpleNamespace:
    loaded = load_family(request, request.param)
    loaded.sizes = SIZES[request.param]
    loaded.inputs = getattr(vision_oracles, f"{request.param}_inputs")
    return loaded


def _media(family, case: str) -> tuple[list, list[Video]]:
    _, images, videos = CASES[case]
    pictures = [tiny_image(seed, family.sizes[size]) for seed, size in images]
    clips = [
        Video(tuple(tiny_image(10 * seed + i, family.sizes[size]) for i in range(4)), fps)
        for seed, size, fps in videos
    ]
    return pictures, clips


def _request(family, case: str):
    prompt, images, videos = CASES[case]
    inputs = family.inputs(family.dir, prompt, *_media(family, case))
    names = {"image": [f"image-{i}" for i in images], "video": [f"video-{v}" for v in videos]}
    return cached_request(family, inputs, names)


def _hf_positions(family, case: str) -> tuple[np.ndarray, int]:
    """transformers' M-RoPE positions (`[3, L]`) and later-token offset of the case's prompt."""
    model = getattr(vision_oracles, f"load_hf_{family.name}")(family.dir)[0]
    inputs = family.inputs(family.dir, CASES[case][0], *_media(family, case))
    keys = ("mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    positions, delta = model.model.get_rope_index(
        inputs["input_ids"], **{k: inputs[k] for k in keys if k in inputs}
    )
    return positions[:, 0].numpy(), int(delta.reshape(-1)[0])


def _items(state, drop: str | None = None) -> list:
    """What the runner passes to `mrope_positions` (`mm.mrope`), optionally without a field."""
    items = []
    for feature in state.mm_features:
        tensors = item_tensors(feature.data)
        tensors.pop(drop, None)
        items.append((feature.modality, tensors))
    return items


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [512, 5], ids=["whole-prompt", "chunks-of-5"])
def test_greedy_tokens_match_transformers(family, case, chunk) -> None:
    state = _request(family, case)
    if chunk < 512:  # some step's window starts inside a video's placeholder
        video = next(f.mm_position for f in state.mm_features if f.modality == "video")
        assert any(video.offset < k < video.offset + video.length for k in range(0, 512, chunk))
    prompt = CASES[case][0]
    pictures, clips = _media(family, case)
    generate = getattr(vision_oracles, f"{family.name}_generate")
    expected = generate(family.dir, prompt, pictures, NEW_TOKENS, videos=clips)
    logits = getattr(vision_oracles, f"{family.name}_logits")(family.dir, prompt, pictures, clips)
    tokens, first = greedy(family.adapter, state, chunk)
    assert tokens == expected
    np.testing.assert_allclose(first, logits[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_match_transformers(family, case) -> None:
    state = _request(family, case)
    table, delta = family.adapter.mrope_positions(list(state.prompt_token_ids), _items(state))
    expected, expected_delta = _hf_positions(family, case)
    np.testing.assert_array_equal(table, expected)
    assert delta == expected_delta
    if family.name == "qwen2_5_vl":  # without the video's seconds its steps sit 2 apart
        ignored, _ = family.adapter.mrope_positions(
            list(state.prompt_token_ids), _items(state, drop="second_per_grid_ts")
        )
        assert (ignored[0] != expected[0]).any()
        np.testing.assert_array_equal(ignored[1:], expected[1:])


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_text_after_a_long_video_continues_past_its_last_step(family) -> None:
    """Two text tokens, a video of two 4x4-patch steps 4 temporal positions apart (2 s per step,
    2 tokens per second), two text tokens: the text after the video starts one past its largest
    position, the temporal one (as vLLM's `get_mrope_input_positions` and Qwen's original
    `get_rope_index` place it; transformers 5 would start at 4, past the rows and columns)."""
    text, pad = 100, family.config["video_token_id"]
    tokens = [text, text] + [pad] * 8 + [text, text]
    video = {"video_grid_thw": np.array([2, 4, 4]), "second_per_grid_ts": np.float32(2.0)}
    table, delta = family.adapter.mrope_positions(tokens, [("video", video)])
    expected = [
        [0, 1, 2, 2, 2, 2, 6, 6, 6, 6, 7, 8],
        [0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 7, 8],
        [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 7, 8],
    ]
    np.testing.assert_array_equal(table, expected)
    assert delta == 9 - 12
