"""Proves the tiny Qwen3-VL checkpoint is a sound oracle for image tests: transformers loads it
without torchvision, its greedy output depends on the image, and mlx-vlm 0.7.10 reads the same
model from the same files: its own forward gives transformers' float32 logits, interleaved M-RoPE
positions and DeepStack included, and its greedy tokens are transformers'."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures import vision_oracles
from tests.fixtures.tiny_qwen3_vl import (
    IM_END_ID,
    IMAGE_MARKUP,
    IMAGE_PAD_ID,
    PATCH_DIM,
    VISION_END_ID,
    VISION_START_ID,
    VOCAB_SIZE,
    image_grid_thw,
    image_token_count,
    tiny_image,
    vl_token_ids,
    write_tiny_qwen3_vl,
)

NEW_TOKENS = 16
ONE_IMAGE = f"<|im_start|>user\n{IMAGE_MARKUP}Describe it.<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = (
    f"<|im_start|>user\n{IMAGE_MARKUP} and {IMAGE_MARKUP}Compare them.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
NO_IMAGE = "<|im_start|>user\nDescribe it.<|im_end|>\n<|im_start|>assistant\n"
# Interleaved M-RoPE with mrope_section [12, 10, 10]: which position (0 temporal, 1 height,
# 2 width) turns each of the 32 rotary frequencies.
INTERLEAVED_AXES = [0, 1, 2] * 10 + [0, 0]


# ------------------------------------------------------------------------------------------------
# Files, processor and transformers
# ------------------------------------------------------------------------------------------------

_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["torchvision"] = None  # as on a host where torchvision is absent or broken
    from transformers import AutoConfig, AutoImageProcessor, Qwen3VLForConditionalGeneration

    model_dir = sys.argv[1]
    config = AutoConfig.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    model, info = Qwen3VLForConditionalGeneration.from_pretrained(
        model_dir, output_loading_info=True
    )
    text, vision = model.config.text_config, model.config.vision_config
    print("RESULT " + json.dumps({
        "config": type(config).__name__,
        "image_processor": type(image_processor).__name__,
        "size": [image_processor.size.shortest_edge, image_processor.size.longest_edge],
        "patch": [image_processor.patch_size, image_processor.merge_size],
        "not_loaded": sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]),
        "text": [text.vocab_size, text.hidden_size, text.num_hidden_layers,
                 text.num_attention_heads, text.num_key_value_heads, text.head_dim,
                 text.intermediate_size],
        "rope": text.rope_parameters,
        "vision": [vision.model_type, vision.depth, vision.hidden_size, vision.num_heads,
                   vision.out_hidden_size, vision.patch_size, vision.num_position_embeddings,
                   list(vision.deepstack_visual_indexes), vision.hidden_act],
        "vision_rope": vision.rope_parameters,
        "tied": model.config.tie_word_embeddings,
        "tokens": [model.config.image_token_id, model.config.vision_start_token_id],
    }))
    """
)


def test_transformers_loads_it_without_torchvision(tiny_qwen3_vl_dir: Path) -> None:
    # A fresh interpreter: importing mlx-vlm's qwen3_vl (another test here) patches
    # AutoProcessor, and torchvision is blocked before transformers is imported.
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(tiny_qwen3_vl_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT ") :]) == {
        "config": "Qwen3VLConfig",
        # The published "Qwen2VLImageProcessorFast" needs torchvision; this is its PIL twin.
        "image_processor": "Qwen2VLImageProcessorPil",
        "size": [64 * 64, 128 * 128],
        "patch": [16, 2],
        "not_loaded": [],
        "text": [VOCAB_SIZE, 256, 2, 4, 2, 64, 512],
        # text_config's rope_scaling and rope_theta, folded together.
        "rope": {
            "rope_type": "default",
            "mrope_section": [12, 10, 10],
            "mrope_interleaved": True,
            "rope_theta": 10000.0,
        },
        "vision": ["qwen3_vl_vision", 3, 64, 2, 256, 16, 36, [0, 1], "gelu_pytorch_tanh"],
        "vision_rope": {"rope_theta": 10000.0, "rope_type": "axial"},  # mlx-vlm's fixed 1e4
        "tied": False,
        "tokens": [IMAGE_PAD_ID, VISION_START_ID],
    }


def test_files_are_in_the_published_layout(tiny_qwen3_vl_dir: Path) -> None:
    from mlx_vlm.models.qwen3_vl.config import ModelConfig, TextConfig
    from safetensors import safe_open

    config = json.loads((tiny_qwen3_vl_dir / "config.json").read_text())
    text = config["text_config"]
    assert "rope_parameters" not in text and "hidden_size" not in config
    assert text["rope_theta"] == 10000.0 and text["head_dim"] == 64 == 2 * sum([12, 10, 10])
    assert text["rope_scaling"] == {
        "rope_type": "default",
        "mrope_section": [12, 10, 10],
        "mrope_interleaved": True,
    }
    assert text["vocab_size"] == VOCAB_SIZE == 779
    assert config["vision_config"]["model_type"] == "qwen3_vl"
    assert config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    # mlx-vlm builds its TextConfig only if text_config has every required field; otherwise the
    # dict stays a dict and the model fails later.
    parsed = ModelConfig.from_dict(config)
    assert isinstance(parsed.text_config, TextConfig)
    with safe_open(str(tiny_qwen3_vl_dir / "model.safetensors"), "np") as weights:
        names = weights.keys()  # a list; the handle itself is not iterable
    assert {".".join(name.split(".")[:2]) for name in names} == {
        "model.visual",
        "model.language_model",
        "lm_head.weight",
    }
    assert "model.visual.deepstack_merger_list.1.linear_fc2.weight" in names
    assert "model.visual.pos_embed.weight" in names
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in names


def test_transformers_loads_every_weight_from_the_file(tiny_qwen3_vl_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    model, _, _ = vision_oracles.load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    stored = load_file(str(tiny_qwen3_vl_dir / "model.safetensors"))
    loaded = dict(model.named_parameters())
    assert loaded.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize(
    ("size", "grid"),
    [
        ((64, 64), (1, 4, 4)),
        ((70, 58), (1, 4, 4)),  # sides rounded to multiples of 32
        ((30, 30), (1, 4, 4)),  # scaled up to min_pixels
        ((128, 128), (1, 8, 8)),
        ((96, 64), (1, 4, 6)),  # (width, height): 4 rows, 6 columns of patches
        ((256, 128), (1, 4, 10)),  # scaled down to max_pixels
    ],
)
def test_processor_patches_and_image_tokens(
    tiny_qwen3_vl_dir: Path, size: tuple[int, int], grid: tuple[int, int, int]
) -> None:
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, ONE_IMAGE, [tiny_image(0, size)])
    t, h, w = grid
    assert image_grid_thw(*size) == grid and image_token_count(*size) == t * h * w // 4
    assert inputs["image_grid_thw"].tolist() == [list(grid)]
    assert tuple(inputs["pixel_values"].shape) == (t * h * w, PATCH_DIM) == (t * h * w, 1536)
    assert str(inputs["pixel_values"].dtype) == "torch.float32"
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(VISION_START_ID)
    n = image_token_count(*size)
    assert ids[start : start + n + 2] == [VISION_START_ID, *[IMAGE_PAD_ID] * n, VISION_END_ID]
    assert ids.count(IMAGE_PAD_ID) == n
    assert inputs["mm_token_type_ids"][0].tolist() == [int(i == IMAGE_PAD_ID) for i in ids]


def test_two_images_concatenate_their_patches(tiny_qwen3_vl_dir: Path) -> None:
    images = [tiny_image(1, (128, 128)), tiny_image(2, (96, 64))]
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, TWO_IMAGES, images)
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 4, 6]]
    assert tuple(inputs["pixel_values"].shape) == (64 + 24, 1536)
    assert inputs["input_ids"][0].tolist().count(IMAGE_PAD_ID) == 16 + 6
    with pytest.raises(ValueError, match=re.escape("2 <|image_pad|> in the prompt, 1 images")):
        vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, TWO_IMAGES, images[:1])


def test_greedy_output_depends_on_the_image(tiny_qwen3_vl_dir: Path) -> None:
    outputs = [
        vision_oracles.qwen3_vl_generate(tiny_qwen3_vl_dir, ONE_IMAGE, [tiny_image(s)], NEW_TOKENS)
        for s in range(4)
    ]
    no_image = vision_oracles.qwen3_vl_generate(tiny_qwen3_vl_dir, NO_IMAGE, [], NEW_TOKENS)
    pair = [tiny_image(0), tiny_image(1, (96, 64))]
    swapped = [
        vision_oracles.qwen3_vl_generate(tiny_qwen3_vl_dir, TWO_IMAGES, images, NEW_TOKENS)
        for images in (pair, pair[::-1])
    ]
    everything = [*outputs, no_image, *swapped]
    assert len({tuple(t) for t in everything}) == 7, everything
    # Varied continuations, and never the vision markup tokens (their output rows are narrow).
    markup = set(vl_token_ids().values())
    for tokens in everything:
        assert len(set(tokens)) >= 8 and not markup & set(tokens), tokens


def test_some_images_end_the_answer_early(tiny_qwen3_vl_dir: Path) -> None:
    image = [tiny_image(2)]
    full = vision_oracles.qwen3_vl_generate(tiny_qwen3_vl_dir, ONE_IMAGE, image, 32)
    stopped = vision_oracles.qwen3_vl_generate(
        tiny_qwen3_vl_dir, ONE_IMAGE, image, 32, stop_at_eos=True
    )
    assert len(full) == 32 and full.index(IM_END_ID) == 11
    assert stopped == full[:12]
    runs_on = vision_oracles.qwen3_vl_generate(
        tiny_qwen3_vl_dir, ONE_IMAGE, [tiny_image(0)], 32, stop_at_eos=True
    )
    assert len(runs_on) == 32 and IM_END_ID not in runs_on


def test_image_positions_use_interleaved_m_rope(tiny_qwen3_vl_dir: Path) -> None:
    import torch

    model, _, _ = vision_oracles.load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, ONE_IMAGE, [tiny_image(0)])
    positions, deltas = model.model.get_rope_index(**inputs)
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(IMAGE_PAD_ID)  # 2x2 merged tokens at (t, row, column) + start
    assert positions[:, 0, start : start + 4].tolist() == [
        [start] * 4,
        [start, start, start + 1, start + 1],
        [start, start + 1, start, start + 1],
    ]
    assert positions[0, 0, start + 4].item() == start + 2  # <|vision_end|> after max(h, w) = 2
    assert deltas.tolist() == [[-2]]  # 4 tokens spanning 2 positions
    # The rotary frequencies each follow one of the three positions, interleaved T, H, W.
    rotary = model.model.language_model.rotary_emb
    axis_of_freq = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 1, 32).clone()
    assert rotary.recomposition_frequencies(axis_of_freq)[0, 0, :32].tolist() == INTERLEAVED_AXES


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_half_precision_checkpoint_holds_the_same_weights(
    tiny_qwen3_vl_dir: Path, tmp_path: Path, dtype: str
) -> None:
    import torch
    from safetensors.torch import load_file

    half_dir = write_tiny_qwen3_vl(tmp_path / dtype, dtype=dtype)
    half = load_file(str(half_dir / "model.safetensors"))
    full = load_file(str(tiny_qwen3_vl_dir / "model.safetensors"))
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(tensor, full[name].to(tensor.dtype)), name
    config = json.loads((half_dir / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == dtype
    for name in ("tokenizer.json", "preprocessor_config.json"):  # the same files otherwise
        assert (half_dir / name).read_bytes() == (tiny_qwen3_vl_dir / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------
# mlx-vlm 0.7.10's own qwen3_vl model
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_vlm_model(tiny_qwen3_vl_dir: Path) -> Iterator[Any]:
    """mlx-vlm's qwen3_vl model loaded by its own loader. Importing that model patches
    `AutoProcessor.from_pretrained` process-wide; the original is put back afterwards so later
    tests in this process see transformers' processor."""
    from transformers import AutoProcessor

    original = AutoProcessor.__dict__["from_pretrained"]
    try:
        from mlx_vlm.utils import load_model

        yield load_model(Path(tiny_qwen3_vl_dir))
    finally:
        AutoProcessor.from_pretrained = original


def _mlx_arrays(inputs: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    names = ("input_ids", "pixel_values", "image_grid_thw")
    return {k: mx.array(inputs[k].numpy()) for k in names if k in inputs}


def _mlx_vlm_logits(
    model: Any, inputs: dict[str, Any], zero_levels: Sequence[int] = ()
) -> tuple[np.ndarray, Any]:
    """mlx-vlm's forward without a KV cache: its `get_input_embeddings` (image features merged
    in, DeepStack features and their token mask, M-RoPE positions from its `get_rope_index`),
    then its language model given all of them explicitly, so that no position state is kept
    from an earlier call. The DeepStack levels in ``zero_levels`` are replaced by zeros.
    Returns (logits, the embedding features)."""
    import mlx.core as mx

    arrays = _mlx_arrays(inputs)
    input_ids, pixel_values = arrays.pop("input_ids"), arrays.pop("pixel_values", None)
    features = model.get_input_embeddings(input_ids, pixel_values, **arrays)
    deepstack = features.deepstack_visual_embeds
    if deepstack is not None:
        deepstack = [
            mx.zeros_like(level) if i in zero_levels else level for i, level in enumerate(deepstack)
        ]
    out = model.language_model(
        input_ids,
        features.inputs_embeds,
        position_ids=features.position_ids,
        visual_pos_masks=features.visual_pos_masks,
        deepstack_visual_embeds=deepstack,
    )
    return np.array(out.logits[0]), features


def test_mlx_vlm_reads_the_same_hyper_parameters(mlx_vlm_model: Any) -> None:
    attention = mlx_vlm_model.language_model.layers[0].self_attn
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (4, 2, 64)
    assert attention.rotary_emb.base == 10000.0
    assert list(attention.rotary_emb.mrope_section) == [12, 10, 10]
    # Its own interleaving (it does not read mrope_interleaved), the same as transformers'.
    assert attention.rotary_emb.style == "interleaved"
    assert np.array(attention.rotary_emb.position_selector).tolist() == INTERLEAVED_AXES
    assert attention.q_norm.weight.shape == (64,)
    tower = mlx_vlm_model.vision_tower
    assert (len(tower.blocks), tower.deepstack_visual_indexes, tower.num_grid_per_side) == (
        3,
        [0, 1],
        6,
    )
    assert len(tower.deepstack_merger_list) == 2
    assert mlx_vlm_model.config.image_token_id == IMAGE_PAD_ID
    assert mlx_vlm_model.config.vision_start_token_id == VISION_START_ID
    assert mlx_vlm_model.language_model.args.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("prompt", "images"),
    [
        (ONE_IMAGE, [(0, (64, 64))]),
        (TWO_IMAGES, [(1, (128, 128)), (2, (96, 64))]),
        (ONE_IMAGE, [(3, (256, 128))]),
        (NO_IMAGE, []),
    ],
    ids=["one-image", "two-images", "wide-image", "no-image"],
)
def test_mlx_vlm_forward_gives_transformers_logits(
    tiny_qwen3_vl_dir: Path,
    mlx_vlm_model: Any,
    prompt: str,
    images: list[tuple[int, tuple[int, int]]],
) -> None:
    pictures = [tiny_image(seed, size) for seed, size in images]
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, prompt, pictures)
    logits, features = _mlx_vlm_logits(mlx_vlm_model, inputs)
    positions = np.array(features.position_ids)
    tokens = inputs["input_ids"].shape[1]
    if images:
        hf_model, _, _ = vision_oracles.load_hf_qwen3_vl(tiny_qwen3_vl_dir)
        hf_positions, hf_deltas = hf_model.model.get_rope_index(**inputs)
        assert np.array_equal(positions, hf_positions.numpy())  # [3, 1, tokens]
        assert np.array(features.rope_deltas).tolist() == hf_deltas.tolist()
    else:
        # Text-only: one 2-D position stream [1, tokens], which its rotary embedding applies
        # to all three axes.
        assert positions.tolist() == [list(range(tokens))]
        assert features.deepstack_visual_embeds is None
    expected = vision_oracles.qwen3_vl_logits(tiny_qwen3_vl_dir, prompt, pictures)
    assert logits.shape == expected.shape == (tokens, VOCAB_SIZE)
    assert np.abs(logits - expected).max() < 1e-4


def test_deepstack_reaches_decoder_layers_0_and_1(
    tiny_qwen3_vl_dir: Path, mlx_vlm_model: Any
) -> None:
    import mlx.core as mx
    import torch

    images = [tiny_image(1, (128, 128)), tiny_image(2, (96, 64))]
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, TWO_IMAGES, images)
    logits, features = _mlx_vlm_logits(mlx_vlm_model, inputs)
    # One [image tokens, text width] array per level, the images' tokens one after the other.
    assert [tuple(level.shape) for level in features.deepstack_visual_embeds] == [(22, 256)] * 2
    mask = np.array(features.visual_pos_masks)
    assert mask[0].tolist() == (inputs["input_ids"][0] == IMAGE_PAD_ID).tolist()
    first = int(np.argmax(mask[0]))

    # Level 0 is added after decoder layer 0, level 1 after layer 1: zeroing level 1 leaves the
    # hidden states after layer 0 as they were, zeroing level 0 changes them at the image tokens
    # only.
    def after_layer_0(zero_levels: Sequence[int]) -> np.ndarray:
        levels = [
            mx.zeros_like(level) if i in zero_levels else level
            for i, level in enumerate(features.deepstack_visual_embeds)
        ]
        hidden = mlx_vlm_model.language_model.model(
            mx.array(inputs["input_ids"].numpy()),
            inputs_embeds=features.inputs_embeds,
            position_ids=features.position_ids,
            visual_pos_masks=features.visual_pos_masks,
            deepstack_visual_embeds=levels,
            stop_after_layer=1,
            apply_final_norm=False,
        )
        return np.array(hidden[0])

    reference = after_layer_0(())
    assert np.array_equal(after_layer_0([1]), reference)
    changed = np.abs(after_layer_0([0]) - reference).max(axis=-1)
    assert changed[~mask[0]].max() == 0 and changed[mask[0]].min() > 0

    # Each level changes the logits after the first image token; zeroing both in transformers
    # (the deepstack mergers' outputs) and in mlx-vlm gives the same logits again.
    for zero_levels in ([0], [1]):
        other, _ = _mlx_vlm_logits(mlx_vlm_model, inputs, zero_levels)
        assert np.abs(other - logits)[first:].max() > 0.1, zero_levels
    mlx_without, _ = _mlx_vlm_logits(mlx_vlm_model, inputs, [0, 1])
    hf_model, _, _ = vision_oracles.load_hf_qwen3_vl(tiny_qwen3_vl_dir)
    hooks = [
        merger.register_forward_hook(lambda _module, _args, output: torch.zeros_like(output))
        for merger in hf_model.model.visual.deepstack_merger_list
    ]
    try:
        hf_without = vision_oracles.qwen3_vl_logits(tiny_qwen3_vl_dir, TWO_IMAGES, images)
    finally:
        for hook in hooks:
            hook.remove()
    assert np.abs(mlx_without - hf_without).max() < 1e-4
    assert np.abs(mlx_without - logits)[first:].max() > 0.5
    assert np.abs(mlx_without - logits)[:first].max() < 1e-5  # before any image: causal


def test_mlx_vlm_greedy_agrees_with_transformers(
    tiny_qwen3_vl_dir: Path, mlx_vlm_model: Any
) -> None:
    # Its generation loop, KV cache and decode-step positions (rope deltas) included.
    from mlx_vlm.generate.ar import generate_step

    images = [tiny_image(1, (128, 128)), tiny_image(2, (96, 64))]
    inputs = vision_oracles.qwen3_vl_inputs(tiny_qwen3_vl_dir, TWO_IMAGES, images)
    arrays = _mlx_arrays(inputs)
    steps = generate_step(
        arrays.pop("input_ids"),
        mlx_vlm_model,
        arrays.pop("pixel_values"),
        None,
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        **arrays,
    )
    tokens = [int(token) for token, _ in steps]
    expected = vision_oracles.qwen3_vl_generate(tiny_qwen3_vl_dir, TWO_IMAGES, images, NEW_TOKENS)
    assert tokens == expected
