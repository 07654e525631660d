"""Gemma 4 with images on the runner's multimodal path (`families.gemma4_vl`): mlx-vlm's tower
beside mlx-lm's language model, the encoder cache, the image rows merged unscaled, the pad token's
per-layer input at image tokens, and the key ends that open each image both ways in the sliding
layers only (bounded below by the window of 8, which every image's 56 to 65 tokens exceed; the
full layers stay causal), over layers of two head sizes, two of which read earlier layers' K/V.
Driven step by step for several requests at once (`media_steps.run_greedy`), against
transformers float32 `Gemma4ForConditionalGeneration.generate` with the processor's
`mm_token_type_ids` (`gemma4_vl_oracle`), which give transformers its bidirectional vision mask.

The engine is not involved: vLLM's Gemma 4 processor imports torchvision, which does not load
here (so the towers do not run behind vLLM's front end, `towers_run()`; they are loaded with
`towers=True`). Each image item is built with vLLM's own `MultiModalKwargsItems.from_hf_inputs`
and the field layout of vLLM's Gemma 4 processor (`pixel_values` and `pixel_position_ids`
batched by image), and its placeholder is where vLLM's prompt update puts it: `<|image>`, the
image tokens, `<image|>`, with `is_embed` on the image tokens.
"""

from __future__ import annotations

import functools
import json

import mlx.core as mx
import numpy as np
import pytest

from tests.backends.mlx.runner.media_steps import request_state, run_greedy
from tests.fixtures import gemma4_vl_oracle as oracle
from tests.fixtures.tiny_gemma4_vl import BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID
from tests.fixtures.tiny_idefics3 import tiny_image

NEW_TOKENS = 8
TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# case -> (prompt, images as (seed, (width, height))); the processor scales each image up to the
# budget of 70 soft tokens: 64, 60, 60 and 65 of them here.
CASES = {
    "one-image": (TURN.format("Look at this: <|image|>What is it?"), [(0, (64, 64))]),
    "two-images": (
        TURN.format("First <|image|> then <|image|>Same?"),
        [(3, (48, 80)), (4, (96, 40))],
    ),
    # The placeholder at position 0 (the tiny tokenizer adds no BOS).
    "image-first": ("<|image|>Describe the picture in detail.", [(5, (128, 48))]),
    "text-only": (TURN.format("What is the capital of Japan?"), []),
}
# Larger prompts, behind `full`: two images back to back (`<image|><|image>` between them, two
# spans) and an image and a text-only prompt more.
FULL_CASES = {
    "adjacent-images": (
        TURN.format("Compare <|image|><|image|> them."),
        [(6, (64, 64)), (7, (40, 120))],
    ),
    "other-image": (TURN.format("And this one? <|image|>"), [(8, (80, 80))]),
    "long-text": (TURN.format("Tell me a story about a dog and a cat and a mouse."), []),
}
# How far the logits may be from transformers float32's. Some prompt tokens' logits, the image
# tokens' most, are sensitive to rounding: transformers float32 is up to 2.8e-2 off its own
# float64 forward, this runner up to 3.7e-2 off transformers float32 and 1.8e-2 off float64 (its
# image rows as close to float64's as transformers float32's), so every prompt token is held to
# 0.1; the prompt's last logits, at most 1.3e-3 off, to 5e-3. What the test guards against
# moves some prompt token's logits by 3.6 or more: image tokens attending causally, or both ways
# in the full layers too (the negative controls below), image rows scaled like text rows, image
# tokens' per-layer inputs of their own id. All but the full layers' also move the greedy tokens
# and the last logits (by 0.8 or more).
PROMPT_TOL = 0.1
LAST_TOL = 5e-3


@pytest.fixture(scope="module")
def gemma4_vl(tiny_gemma4_vl_dir):
    from vllm_metal.models import load_model

    config = json.loads((tiny_gemma4_vl_dir / "config.json").read_text())
    adapter = load_model(
        str(tiny_gemma4_vl_dir), compute_dtype=mx.float32, hf_config=config, towers=True
    )
    return tiny_gemma4_vl_dir, adapter


def _case(case: str) -> tuple[str, list]:
    prompt, images = {**CASES, **FULL_CASES}[case]
    return prompt, [tiny_image(seed, size) for seed, size in images]


def _request(model_dir, case: str):
    """vLLM's view of the case's prompt: token ids and one `MultiModalFeatureSpec` per image."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    inputs = oracle.gemma4_inputs(model_dir, *_case(case))
    ids = inputs["input_ids"][0].numpy()
    features = []
    if "pixel_values" in inputs:
        hf = {
            "pixel_values": inputs["pixel_values"],
            "pixel_position_ids": inputs["image_position_ids"],  # vLLM's name
        }
        fields = {name: MultiModalFieldConfig.batched("image") for name in hf}
        items = MultiModalKwargsItems.from_hf_inputs(hf, fields)["image"]
        bois = np.flatnonzero(ids == BOI_TOKEN_ID).tolist()
        counts = inputs["num_soft_tokens_per_image"].tolist()
        for k, (item, offset, count) in enumerate(zip(items, bois, counts, strict=True)):
            span = ids[offset : offset + count + 2]
            assert span[-1] == EOI_TOKEN_ID and (span[1:-1] == IMAGE_TOKEN_ID).all()
            features.append(
                MultiModalFeatureSpec(
                    data=item,
                    modality="image",
                    identifier=f"{case}-image-{k}",
                    mm_position=PlaceholderRange(
                        offset=offset,
                        length=count + 2,
                        is_embed=torch.from_numpy(span == IMAGE_TOKEN_ID),
                    ),
                    mm_hash=None,
                )
            )
    return request_state(case, ids.tolist(), features)


@functools.lru_cache(maxsize=16)
def _expected(model_dir, case: str) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens of the case's prompt alone and its logits of every prompt
    token."""
    tokens, last = oracle.gemma4_generate(model_dir, *_case(case), NEW_TOKENS)
    logits = oracle.gemma4_prompt_logits(model_dir, *_case(case))
    np.testing.assert_allclose(last, logits[-1], rtol=0, atol=1e-5)  # generate's own prefill
    return tokens, logits


def _run(adapter, model_dir, cases, chunk: int, new_tokens: int = NEW_TOKENS, **kwargs):
    """Each case's greedy tokens, its last prompt logits and its logits of every prompt token,
    all cases in one batch."""
    states = {case: _request(model_dir, case) for case in cases}
    prompt_logits: dict[str, np.ndarray] = {}
    got = run_greedy(
        adapter,
        states,
        chunk=chunk,
        new_tokens=new_tokens,
        prompt_logits=prompt_logits,
        **kwargs,
    )
    return {case: (*got[case], prompt_logits[case]) for case in cases}


def _assert_matches(got: dict, model_dir) -> None:
    for case, (tokens, last, logits) in got.items():
        want_tokens, want_logits = _expected(model_dir, case)
        assert tokens == want_tokens, case
        np.testing.assert_allclose(last, want_logits[-1], rtol=0, atol=LAST_TOL, err_msg=case)
        np.testing.assert_allclose(logits, want_logits, rtol=0, atol=PROMPT_TOL, err_msg=case)


@pytest.mark.parametrize(
    "chunk", [512, 70], ids=["whole-prompts", "chunks-of-70-keeping-images-whole"]
)
def test_a_mixed_batch_matches_transformers(gemma4_vl, chunk) -> None:
    """The four prompts in one batch: each request's greedy tokens and logits equal transformers'
    for that prompt alone. In chunks of 70 that stop before an image they would cut
    (`disable_chunked_mm_input`, which the platform sets for this model), the second image of
    "two-images" and the ends of the longer prompts come in later steps, their sliding windows
    reaching back into the pages of earlier ones."""
    model_dir, adapter = gemma4_vl
    _assert_matches(_run(adapter, model_dir, CASES, chunk, keep_items_whole=True), model_dir)


@pytest.mark.full
@pytest.mark.parametrize("chunk", [512, 67, 100])
def test_more_prompts_match_transformers(gemma4_vl, chunk) -> None:
    """All seven prompts in one batch, in chunks as short as an image's placeholder allows."""
    model_dir, adapter = gemma4_vl
    cases = [*CASES, *FULL_CASES]
    _assert_matches(_run(adapter, model_dir, cases, chunk, keep_items_whole=True), model_dir)


def _gap(adapter, model_dir, case: str, **kwargs) -> tuple[float, float]:
    """How far the case's last prompt logits and all its prompt logits are from transformers'."""
    _, last, logits = _run(adapter, model_dir, [case], chunk=512, new_tokens=1, **kwargs)[case]
    _, want = _expected(model_dir, case)
    return float(np.abs(last - want[-1]).max()), float(np.abs(logits - want).max())


def test_causal_or_all_layer_attention_over_images_would_not_match(gemma4_vl) -> None:
    """The negative controls: image tokens attending causally everywhere, or both ways in the
    full layers too (as Gemma 3's do), leave transformers' logits. The latter shows at the image
    tokens and the text within a window after them only: in this checkpoint the later layers
    attend over earlier layers' K/V, which a full layer's mask does not change."""
    model_dir, adapter = gemma4_vl
    last, every = _gap(adapter, model_dir, "one-image", key_ends=False)
    assert last > 10 * LAST_TOL and every > 10 * PROMPT_TOL
    adapter.bidirectional_sliding_only = False
    try:
        _, every = _gap(adapter, model_dir, "one-image")
    finally:
        adapter.bidirectional_sliding_only = True
    assert every > 10 * PROMPT_TOL
