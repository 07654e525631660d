"""Qwen2.5-VL and Qwen3-VL on the runner's multimodal path: the encoder cache, the M-RoPE
positions, DeepStack rows (Qwen3-VL) and the packed paged forward, driven step by step as vLLM's
scheduler drives them (prefill in chunks that may cut an image span, then one token per step),
against transformers float32.

vLLM 0.32 cannot serve the Qwen-VL families on Linux (its processor imports torchvision, which does not load
beside torch 2.13.0+cpu), so the engine is not involved: each image item is built with vLLM's own
`MultiModalKwargsItems.from_hf_inputs` and the field layout of vLLM's Qwen2-VL processor
(`pixel_values` flat by `image_grid_thw.prod()`, the grid kept on the host), from the
checkpoint's image processor; the placeholder is the run of `<|image_pad|>` tokens. The macOS job
runs the same models through `vllm serve`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.backends.mlx.runner.batch import pack_batch
from vllm_metal.backends.mlx.runner.forward import forward
from vllm_metal.backends.mlx.runner.mm.embeddings import EncoderCache
from vllm_metal.backends.mlx.runner.mm.mrope import step_positions
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.testing import oracles
from vllm_metal.testing.tiny_idefics3 import tiny_image

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

BLOCK_SIZE = 16
NEW_TOKENS = 8
ONE_IMAGE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
TWO_IMAGES = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>and"
    "<|vision_start|><|image_pad|><|vision_end|>Same?<|im_end|>\n"
)
TEXT_ONLY = "<|im_start|>user\nWhat is it?<|im_end|>\n"
# family -> (checkpoint fixture, square, wide and tall image sizes: 4, 8 and 8 image tokens)
FAMILIES = {
    "qwen2_5_vl": ("tiny_qwen2_5_vl_dir", (56, 56), (112, 56), (56, 112)),
    "qwen3_vl": ("tiny_qwen3_vl_dir", (64, 64), (128, 64), (64, 128)),
}
# case -> (prompt, images as (seed, size index into the family's sizes))
CASES = {
    "one-image": (ONE_IMAGE, [(0, 0)]),
    "other-image": (ONE_IMAGE, [(1, 0)]),
    "wide-image": (ONE_IMAGE, [(2, 1)]),
    "two-images": (TWO_IMAGES, [(3, 0), (4, 2)]),
    "text-only": (TEXT_ONLY, []),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(family, checkpoint directory, image sizes, adapter) of each Qwen-VL family."""
    from vllm_metal.models import load_model

    fixture, *sizes = FAMILIES[request.param]
    model_dir = request.getfixturevalue(fixture)
    config = json.loads((model_dir / "config.json").read_text())
    adapter = load_model(str(model_dir), compute_dtype=mx.float32, hf_config=config)
    return SimpleNamespace(name=request.param, dir=model_dir, sizes=sizes, adapter=adapter)


def _pictures(family, images) -> list:
    return [tiny_image(seed, family.sizes[size]) for seed, size in images]


def _request(family, prompt: str, images: list) -> CachedRequestState:
    """vLLM's view of the prompt: its token ids and one `MultiModalFeatureSpec` per image."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalFieldConfig,
        MultiModalKwargsItems,
        PlaceholderRange,
    )
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    pictures = _pictures(family, images)
    inputs = getattr(oracles, f"{family.name}_inputs")(family.dir, prompt, pictures)
    ids = inputs["input_ids"][0].tolist()
    features = []
    if pictures:
        grid = inputs["image_grid_thw"]
        items = MultiModalKwargsItems.from_hf_inputs(
            inputs,
            {
                "pixel_values": MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
                "image_grid_thw": MultiModalFieldConfig.batched("image", keep_on_cpu=True),
            },
        )["image"]
        pad = json.loads((family.dir / "config.json").read_text())["image_token_id"]
        starts = [i for i, t in enumerate(ids) if t == pad and (i == 0 or ids[i - 1] != pad)]
        for k, (item, start) in enumerate(zip(items, starts)):
            length = int(grid[k].prod()) // 4
            assert ids[start : start + length] == [pad] * length
            features.append(
                MultiModalFeatureSpec(
                    data=item,
                    modality="image",
                    identifier=f"image-{images[k]}",
                    mm_position=PlaceholderRange(offset=start, length=length),
                    mm_hash=None,
                )
            )
    return CachedRequestState(
        req_id="r",
        prompt_token_ids=ids,
        mm_features=features,
        sampling_params=None,
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


def _greedy(adapter, state, chunk: int) -> tuple[list[int], np.ndarray]:
    """Prefill `chunk` tokens per step (encoding each image in the step that first reaches its
    span, as vLLM's scheduler does), then decode one token per step; greedy. Also the logits of
    the prompt's last token."""
    tokens = list(state.prompt_token_ids)
    prompt_len = len(tokens)
    num_blocks = -(-(prompt_len + NEW_TOKENS) // BLOCK_SIZE)
    pool = KVPool(
        KVLayout.single_group(adapter.num_layers, num_blocks, BLOCK_SIZE),
        adapter.language_model.model.layers[0].self_attn.n_kv_heads,
        adapter.language_model.model.layers[0].self_attn.head_dim,
        mx.float32,
    )
    table = np.arange(num_blocks, dtype=np.int32)[None]
    cache = EncoderCache()
    requests = {"r": state}
    computed, new = 0, []
    while len(new) < NEW_TOKENS:
        n = min(chunk, prompt_len - computed) if computed < prompt_len else 1
        scheduled = [
            k
            for k, f in enumerate(state.mm_features)
            if f.identifier not in cache.outputs
            and f.mm_position.offset < computed + n
            and f.mm_position.offset + f.mm_position.length > computed
        ]
        step = SimpleNamespace(
            free_encoder_mm_hashes=[],
            scheduled_encoder_inputs={"r": scheduled} if scheduled else {},
        )
        packed = pack_batch(
            ["r"],
            {"r": n},
            np.array([computed]),
            np.array([len(tokens)]),
            np.array([tokens + [0] * (prompt_len + NEW_TOKENS - len(tokens))]),
            [table],
            [BLOCK_SIZE],
        )
        cache.update(step, requests, adapter)
        rows = cache.step_rows(packed, requests)
        positions = step_positions(packed, requests, adapter)
        logits, _ = forward(adapter, pool, [None] * adapter.num_layers, packed, {}, rows, positions)
        computed += n
        if computed >= len(tokens):
            if not new:
                first = np.array(logits[0])
            tokens.append(int(mx.argmax(logits[0]).item()))
            new.append(tokens[-1])
    return new, first


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("chunk", [512, 5], ids=["whole-prompt", "chunks-of-5"])
def test_greedy_tokens_match_transformers(family, case, chunk) -> None:
    prompt, images = CASES[case]
    state = _request(family, prompt, images)
    pictures = _pictures(family, images)
    expected = getattr(oracles, f"{family.name}_generate")(family.dir, prompt, pictures, NEW_TOKENS)
    expected_logits = getattr(oracles, f"{family.name}_logits")(family.dir, prompt, pictures)
    tokens, logits = _greedy(family.adapter, state, chunk)
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
