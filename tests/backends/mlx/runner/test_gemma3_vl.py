"""Gemma 3 with images on the runner's multimodal path: the encoder cache, the prefix-LM key ends
(one image's tokens attend to each other both ways, sliding windows still anchored at each
token) and the packed paged forward, driven step by step for several requests at once
(`media_steps.run_greedy`), against transformers float32 with `token_type_ids`.

vLLM 0.32 cannot build a Gemma 3 config on Linux (its processor module imports transformers'
torchvision image processor), so the engine is not involved: each image item is built with
vLLM's own `MultiModalKwargsItems.from_hf_inputs` and the field layout of vLLM's Gemma 3
processor (`pixel_values` flat by `num_patches`, the crop count kept on the host), and its
placeholder is where vLLM's prompt update puts it: `\\n\\n<start_of_image>`, the image tokens,
`<end_of_image>\\n\\n`, with `is_embed` on the image tokens. The tiny checkpoint's sliding window
(6) is shorter than an image (9 tokens), and every image sits past it.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tests.backends.mlx.runner.media_steps import request_state, run_greedy
from tests.fixtures import vision_oracles as oracle
from tests.fixtures.tiny_gemma3 import (
    BOI_TOKEN_ID,
    EOI_TOKEN_ID,
    IMAGE_TOKEN_ID,
    TOKENS_PER_IMAGE,
    tiny_image,
)

NEW_TOKENS = 8
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# case -> (prompt, image seeds); images are 64x64 unless the case is in WIDE
CASES = {
    "one-image": (TURN.format("Look at this: <start_of_image>What is it?"), [0]),
    "other-image": (TURN.format("Look at this: <start_of_image>What is it?"), [2]),
    "two-images": (TURN.format("First <start_of_image> then <start_of_image>Same?"), [3, 4]),
    "image-first": (TURN.format("<start_of_image>Describe the picture in detail."), [5]),
    "pan-and-scan": (TURN.format("See <start_of_image>What?"), [6]),
    "text-only": (TURN.format("What is the capital of Japan?"), []),
}
WIDE = {"pan-and-scan": (144, 48)}
# Pan-and-scan (`--mm-processor-kwargs`): the wide image is the whole image plus three crops,
# four runs of image tokens in one placeholder, each its own bidirectional span.
PROCESSOR_KWARGS = {
    "pan-and-scan": {
        "do_pan_and_scan": True,
        "pan_and_scan_min_crop_size": 16,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
}


def _images(case: str) -> list:
    return [tiny_image(seed, WIDE.get(case, (64, 64))) for seed in CASES[case][1]]


# The markup vLLM's placeholder holds around the image tokens: "\n\n" (two tokens here) before
# <start_of_image> and after <end_of_image>.
NEWLINES = 2


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_dir):
    from vllm_metal.models import load_model

    config = json.loads((tiny_gemma3_dir / "config.json").read_text())
    adapter = load_model(str(tiny_gemma3_dir), compute_dtype=mx.float32, hf_config=config)
    return tiny_gemma3_dir, adapter


def _request(model_dir, case: str):
    """vLLM's view of the case's prompt: token ids and one `MultiModalFeatureSpec` per image."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    prompt, seeds = CASES[case]
    inputs = oracle.gemma3_inputs(model_dir, prompt, _images(case), PROCESSOR_KWARGS.get(case))
    ids = inputs["input_ids"][0].numpy()
    features = []
    if seeds:
        # Crops per image: one, or all of them for the single pan-and-scan image.
        crops = [len(inputs["pixel_values"])] if case in PROCESSOR_KWARGS else [1] * len(seeds)
        inputs["num_patches"] = torch.tensor(crops)
        fields = {
            "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", inputs["num_patches"]),
            "num_patches": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
        }
        items = MultiModalKwargsItems.from_hf_inputs(inputs, fields)["image"]
        bois = iter(np.flatnonzero(ids == BOI_TOKEN_ID).tolist())
        for k, (item, n) in enumerate(zip(items, crops, strict=True)):
            runs = [next(bois) for _ in range(n)]
            offset = runs[0] - NEWLINES
            length = runs[-1] + 1 + TOKENS_PER_IMAGE + 1 + NEWLINES - offset
            span = ids[offset : offset + length]
            assert span[NEWLINES] == BOI_TOKEN_ID and span[-NEWLINES - 1] == EOI_TOKEN_ID
            assert (span == IMAGE_TOKEN_ID).sum() == n * TOKENS_PER_IMAGE
            features.append(
                MultiModalFeatureSpec(
                    data=item,
                    modality="image",
                    identifier=f"{case}-image-{k}",
                    mm_position=PlaceholderRange(
                        offset=offset,
                        length=length,
                        is_embed=torch.from_numpy(span == IMAGE_TOKEN_ID),
                    ),
                    mm_hash=None,
                )
            )
    return request_state(case, ids.tolist(), features)


def _expected(model_dir, case: str) -> tuple[list[int], np.ndarray]:
    prompt, _ = CASES[case]
    images, kwargs = _images(case), PROCESSOR_KWARGS.get(case)
    tokens = oracle.gemma3_generate(model_dir, prompt, images, NEW_TOKENS, kwargs)
    return tokens, oracle.gemma3_logits(model_dir, prompt, images, kwargs)[-1]


@pytest.mark.parametrize(
    "chunk", [512, 16], ids=["whole-prompts", "chunks-of-16-keeping-images-whole"]
)
def test_a_mixed_batch_matches_transformers(gemma3, chunk) -> None:
    """All six prompts in one batch: each request's greedy tokens and last prompt logits equal
    transformers' for that prompt alone."""
    model_dir, adapter = gemma3
    states = {case: _request(model_dir, case) for case in CASES}
    got = run_greedy(adapter, states, chunk=chunk, new_tokens=NEW_TOKENS, keep_items_whole=True)
    for case in CASES:
        tokens, logits = _expected(model_dir, case)
        assert got[case][0] == tokens, case
        np.testing.assert_allclose(got[case][1], logits, rtol=1e-4, atol=1e-4, err_msg=case)


def test_causal_attention_over_images_would_not_match(gemma3) -> None:
    """The negative control: without the key ends, the image prompts' logits leave transformers'
    (the text-only prompt's do not)."""
    model_dir, adapter = gemma3
    states = {case: _request(model_dir, case) for case in ("one-image", "text-only")}
    got = run_greedy(adapter, states, chunk=512, new_tokens=1, key_ends=False)
    _, with_image = _expected(model_dir, "one-image")
    _, text_only = _expected(model_dir, "text-only")
    assert np.abs(got["one-image"][1] - with_image).max() > 1e-2
    np.testing.assert_allclose(got["text-only"][1], text_only, rtol=1e-4, atol=1e-4)


def test_an_image_cut_across_steps_would_not_match(gemma3) -> None:
    """Why the platform sets `disable_chunked_mm_input` for Gemma 3: chunks of 16 that cut the
    image placeholders leave the first part of an image blind to the rest."""
    model_dir, adapter = gemma3
    states = {case: _request(model_dir, case) for case in ("one-image", "two-images")}
    got = run_greedy(adapter, states, chunk=16, new_tokens=1, keep_items_whole=False)
    for case in states:
        _, logits = _expected(model_dir, case)
        assert np.abs(got[case][1] - logits).max() > 1e-2, case


def test_key_ends_cover_each_image_run_of_the_step(gemma3) -> None:
    """`step_key_ends` on a step whose chunk ends right after the first image: that image's
    tokens reach its last token, the text around it and the second request stay causal."""
    from vllm_metal.backends.mlx.runner.batch import pack_batch
    from vllm_metal.backends.mlx.runner.mm.spans import step_key_ends

    model_dir, _ = gemma3
    states = {c: _request(model_dir, c) for c in ("two-images", "text-only")}
    first = states["two-images"].mm_features[0].mm_position
    ((image_start, image_end),) = first.extract_embeds_range()
    chunk = first.offset + first.length  # through the first image's placeholder
    ids = [states[c].prompt_token_ids for c in states]
    width = max(map(len, ids))
    packed = pack_batch(
        list(states),
        {"two-images": chunk, "text-only": 4},
        np.array([0, 0]),
        np.array([len(t) for t in ids]),
        np.array([t + [0] * (width - len(t)) for t in ids]),
        [np.arange(2 * 8, dtype=np.int32).reshape(2, 8)],
        [16],
    )
    ends = step_key_ends(packed, states)
    want = np.zeros(chunk + 4, dtype=np.int32)
    want[image_start : image_end + 1] = image_end + 1
    np.testing.assert_array_equal(ends, want)
    assert image_end - image_start + 1 == TOKENS_PER_IMAGE
