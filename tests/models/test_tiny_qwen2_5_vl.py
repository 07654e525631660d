"""Proves the tiny Qwen2.5-VL checkpoint is a sound oracle for image tests: transformers loads it
without torchvision, its greedy output depends on the image, and mlx-vlm 0.7.10 reads the same
model from the same files: its own forward gives transformers' float32 logits, M-RoPE positions
included, and its greedy tokens are transformers'."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures import vision_oracles
from tests.fixtures.tiny_qwen2_5_vl import (
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
    write_tiny_qwen2_5_vl,
)

NEW_TOKENS = 16
ONE_IMAGE = f"<|im_start|>user\n{IMAGE_MARKUP}Describe it.<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = (
    f"<|im_start|>user\n{IMAGE_MARKUP} and {IMAGE_MARKUP}Compare them.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
NO_IMAGE = "<|im_start|>user\nDescribe it.<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------
# Files, processor and transformers
# ------------------------------------------------------------------------------------------------

_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["torchvision"] = None  # as on a host where torchvision is absent or broken
    from transformers import AutoConfig, AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model_dir = sys.argv[1]
    config = AutoConfig.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir)
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, output_loading_info=True
    )
    text, vision = model.config.text_config, model.config.vision_config
    print("RESULT " + json.dumps({
        "config": type(config).__name__,
        "image_processor": type(image_processor).__name__,
        "size": [image_processor.size.shortest_edge, image_processor.size.longest_edge],
        "not_loaded": sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]),
        "text": [text.vocab_size, text.hidden_size, text.num_hidden_layers,
                 text.num_attention_heads, text.num_key_value_heads, text.intermediate_size],
        "rope": text.rope_parameters,
        "vision": [vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size,
                   vision.window_size, list(vision.fullatt_block_indexes)],
        "tokens": [model.config.image_token_id, model.config.vision_start_token_id],
    }))
    """
)


def test_transformers_loads_it_without_torchvision(tiny_qwen2_5_vl_dir: Path) -> None:
    # A fresh interpreter: importing mlx-vlm's qwen2_5_vl (another test here) patches
    # AutoProcessor, and torchvision is blocked before transformers is imported.
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(tiny_qwen2_5_vl_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stderr[-3000:]
    assert json.loads(lines[-1][len("RESULT ") :]) == {
        "config": "Qwen2_5_VLConfig",
        "image_processor": "Qwen2VLImageProcessorPil",
        "size": [56 * 56, 112 * 112],
        "not_loaded": [],
        "text": [VOCAB_SIZE, 256, 2, 4, 2, 512],
        # The flat config's rope_scaling {"type": "mrope", ...} and root rope_theta, folded in.
        "rope": {
            "type": "mrope",
            "rope_type": "default",
            "mrope_section": [8, 12, 12],
            "rope_theta": 10000.0,
        },
        "vision": [2, 64, 2, 256, 56, [1]],
        "tokens": [IMAGE_PAD_ID, VISION_START_ID],
    }


def test_files_are_in_the_published_layout(tiny_qwen2_5_vl_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((tiny_qwen2_5_vl_dir / "config.json").read_text())
    # mlx-vlm builds its text config from these root keys; no nested text_config.
    assert "text_config" not in config and "rope_parameters" not in config
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [8, 12, 12]}
    assert config["rope_theta"] == 10000.0
    assert config["hidden_size"] // config["num_attention_heads"] == 64 == 2 * sum([8, 12, 12])
    assert config["vocab_size"] == VOCAB_SIZE == 779
    assert config["vision_config"]["model_type"] == "qwen2_5_vl"
    assert config["vision_config"]["out_hidden_size"] == config["hidden_size"]
    with safe_open(str(tiny_qwen2_5_vl_dir / "model.safetensors"), "np") as weights:
        names = weights.keys()  # a list; the handle itself is not iterable
    assert {name.split(".")[0] for name in names} == {"visual", "model", "lm_head"}


def test_transformers_loads_every_weight_from_the_file(tiny_qwen2_5_vl_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    model, _, _ = vision_oracles.load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    stored = load_file(str(tiny_qwen2_5_vl_dir / "model.safetensors"))
    loaded = {
        name.replace("model.visual.", "visual.").replace("model.language_model.", "model."): p
        for name, p in model.named_parameters()
    }
    assert loaded.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize(
    ("size", "grid"),
    [
        ((56, 56), (1, 4, 4)),
        ((64, 64), (1, 4, 4)),  # sides rounded to multiples of 28
        ((30, 30), (1, 4, 4)),  # scaled up to min_pixels
        ((112, 112), (1, 8, 8)),
        ((84, 56), (1, 4, 6)),  # (width, height): 4 rows, 6 columns of patches
        ((200, 100), (1, 4, 10)),  # scaled down to max_pixels
    ],
)
def test_processor_patches_and_image_tokens(
    tiny_qwen2_5_vl_dir: Path, size: tuple[int, int], grid: tuple[int, int, int]
) -> None:
    inputs = vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, ONE_IMAGE, [tiny_image(0, size)])
    t, h, w = grid
    assert image_grid_thw(*size) == grid and image_token_count(*size) == t * h * w // 4
    assert inputs["image_grid_thw"].tolist() == [list(grid)]
    assert tuple(inputs["pixel_values"].shape) == (t * h * w, PATCH_DIM) == (t * h * w, 1176)
    assert str(inputs["pixel_values"].dtype) == "torch.float32"
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(VISION_START_ID)
    n = image_token_count(*size)
    assert ids[start : start + n + 2] == [VISION_START_ID, *[IMAGE_PAD_ID] * n, VISION_END_ID]
    assert ids.count(IMAGE_PAD_ID) == n
    assert inputs["mm_token_type_ids"][0].tolist() == [int(i == IMAGE_PAD_ID) for i in ids]


def test_two_images_concatenate_their_patches(tiny_qwen2_5_vl_dir: Path) -> None:
    images = [tiny_image(1, (112, 112)), tiny_image(2, (84, 56))]
    inputs = vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, TWO_IMAGES, images)
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 4, 6]]
    assert tuple(inputs["pixel_values"].shape) == (64 + 24, 1176)
    assert inputs["input_ids"][0].tolist().count(IMAGE_PAD_ID) == 16 + 6
    with pytest.raises(ValueError, match=re.escape("2 <|image_pad|> in the prompt, 1 images")):
        vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, TWO_IMAGES, images[:1])


def test_chat_template_writes_qwen_vl_markup(tiny_qwen2_5_vl_dir: Path) -> None:
    _, _, tokenizer = vision_oracles.load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "A red square."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{ONE_IMAGE}A red square.<|im_end|>\n"
        f"<|im_start|>user\n{IMAGE_MARKUP}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token_id == IM_END_ID


def test_greedy_output_depends_on_the_image(tiny_qwen2_5_vl_dir: Path) -> None:
    outputs = [
        vision_oracles.qwen2_5_vl_generate(
            tiny_qwen2_5_vl_dir, ONE_IMAGE, [tiny_image(s)], NEW_TOKENS
        )
        for s in range(4)
    ]
    no_image = vision_oracles.qwen2_5_vl_generate(tiny_qwen2_5_vl_dir, NO_IMAGE, [], NEW_TOKENS)
    pair = [tiny_image(0), tiny_image(1, (84, 56))]
    swapped = [
        vision_oracles.qwen2_5_vl_generate(tiny_qwen2_5_vl_dir, TWO_IMAGES, images, NEW_TOKENS)
        for images in (pair, pair[::-1])
    ]
    everything = [*outputs, no_image, *swapped]
    assert len({tuple(t) for t in everything}) == 7, everything
    # Varied continuations, and never the vision markup tokens (their output rows are narrow).
    markup = set(vl_token_ids().values())
    for tokens in everything:
        assert len(set(tokens)) >= 8 and not markup & set(tokens), tokens


def test_image_positions_use_m_rope(tiny_qwen2_5_vl_dir: Path) -> None:
    # Without mm_token_type_ids transformers 5 numbers image tokens as text: other logits.
    import torch

    model, _, _ = vision_oracles.load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
    inputs = vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, ONE_IMAGE, [tiny_image(0)])
    positions, _ = model.model.get_rope_index(**inputs)
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(IMAGE_PAD_ID)  # 2x2 merged tokens at (t, row, column) + start
    assert positions[:, 0, start : start + 4].tolist() == [
        [start] * 4,
        [start, start, start + 1, start + 1],
        [start, start + 1, start, start + 1],
    ]
    assert positions[0, 0, start + 5].item() == start + 3  # after <|vision_end|> at start + 2
    with_m_rope = vision_oracles.qwen2_5_vl_logits(tiny_qwen2_5_vl_dir, ONE_IMAGE, [tiny_image(0)])
    text_positions = {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        plain = model(**text_positions, use_cache=False).logits[0].numpy()
    model.model.rope_deltas = None
    assert np.abs(plain - with_m_rope)[start + 1 :].max() > 1.0


def test_some_images_end_the_answer_early(tiny_qwen2_5_vl_dir: Path) -> None:
    image = [tiny_image(6)]
    full = vision_oracles.qwen2_5_vl_generate(tiny_qwen2_5_vl_dir, ONE_IMAGE, image, 32)
    stopped = vision_oracles.qwen2_5_vl_generate(
        tiny_qwen2_5_vl_dir, ONE_IMAGE, image, 32, stop_at_eos=True
    )
    assert len(full) == 32 and full.index(IM_END_ID) == 10
    assert stopped == full[:11]
    runs_on = vision_oracles.qwen2_5_vl_generate(
        tiny_qwen2_5_vl_dir, ONE_IMAGE, [tiny_image(1)], 32, stop_at_eos=True
    )
    assert len(runs_on) == 32 and IM_END_ID not in runs_on


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_hold_the_same_weights(
    tiny_qwen2_5_vl_dir: Path, tmp_path: Path, dtype: str
) -> None:
    import torch
    from safetensors.torch import load_file

    half_dir = write_tiny_qwen2_5_vl(tmp_path / dtype, dtype=dtype)
    half = load_file(str(half_dir / "model.safetensors"))
    full = load_file(str(tiny_qwen2_5_vl_dir / "model.safetensors"))
    assert half.keys() == full.keys()
    for name, tensor in half.items():
        assert tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(tensor, full[name].to(tensor.dtype)), name
    assert json.loads((half_dir / "config.json").read_text())["torch_dtype"] == dtype


def test_same_seed_same_files_other_seed_other_weights(
    tiny_qwen2_5_vl_dir: Path, tmp_path: Path
) -> None:
    again = write_tiny_qwen2_5_vl(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_qwen2_5_vl_dir / name).read_bytes(), name
    other = write_tiny_qwen2_5_vl(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------
# mlx-vlm 0.7.10's own qwen2_5_vl model
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def mlx_vlm_model(tiny_qwen2_5_vl_dir: Path) -> Iterator[Any]:
    """mlx-vlm's qwen2_5_vl model loaded by its own loader. Importing that model patches
    `AutoProcessor.from_pretrained` process-wide; the original is put back afterwards so later
    tests in this process see transformers' processor."""
    from transformers import AutoProcessor

    original = AutoProcessor.__dict__["from_pretrained"]
    try:
        from mlx_vlm.utils import load_model

        yield load_model(Path(tiny_qwen2_5_vl_dir))
    finally:
        AutoProcessor.from_pretrained = original


def _mlx_arrays(inputs: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    names = ("input_ids", "pixel_values", "image_grid_thw")
    return {k: mx.array(inputs[k].numpy()) for k in names if k in inputs}


def _mlx_vlm_logits(model: Any, inputs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """mlx-vlm's forward without a KV cache: its embeddings (image features merged in) and the
    M-RoPE positions its `get_rope_index` computes, given explicitly to its language model so
    no position state is kept from an earlier call. Returns (logits, positions)."""
    arrays = _mlx_arrays(inputs)
    input_ids, pixel_values = arrays.pop("input_ids"), arrays.pop("pixel_values", None)
    features = model.get_input_embeddings(input_ids, pixel_values, **arrays)
    out = model.language_model(
        input_ids, features.inputs_embeds, position_ids=features.position_ids
    )
    return np.array(out.logits[0]), np.array(features.position_ids)


def test_mlx_vlm_reads_the_same_hyper_parameters(mlx_vlm_model: Any) -> None:
    attention = mlx_vlm_model.language_model.layers[0].self_attn
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (4, 2, 64)
    assert attention.rotary_emb.base == 10000.0  # its default would be 1e6
    assert list(attention.rotary_emb.mrope_section) == [8, 12, 12]
    tower = mlx_vlm_model.vision_tower
    assert (tower.window_size, tower.fullatt_block_indexes, len(tower.blocks)) == (56, [1], 2)
    assert mlx_vlm_model.config.image_token_id == IMAGE_PAD_ID
    assert mlx_vlm_model.config.vision_start_token_id == VISION_START_ID
    assert mlx_vlm_model.language_model.args.tie_word_embeddings is False


@pytest.mark.parametrize(
    ("grid", "window_ends"),
    [
        ((1, 4, 4), [16]),  # one window
        ((1, 8, 8), [16, 32, 48, 64]),  # 2x2 windows of 4x4 patches
        ((1, 4, 6), [16, 24]),  # a 4x4 and a 4x2 window
        ((1, 4, 10), [16, 32, 40]),
    ],
)
def test_mlx_vlm_cuts_the_same_attention_windows(
    tiny_qwen2_5_vl_dir: Path,
    mlx_vlm_model: Any,
    grid: tuple[int, int, int],
    window_ends: list[int],
) -> None:
    # Block 0 attends within 56x56-pixel windows; the patches are reordered window by window.
    import mlx.core as mx
    import torch
    from transformers.vision_utils import get_vision_window_index

    visual = vision_oracles.load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)[0].model.visual
    order, ends = get_vision_window_index(
        torch.tensor([grid]),
        spatial_merge_size=visual.spatial_merge_size,
        window_size=visual.window_size,
        patch_size=visual.patch_size,
    )
    assert ends.tolist() == [0, *window_ends]
    mlx_order, mlx_ends = mlx_vlm_model.vision_tower.get_window_index(mx.array([grid]))
    # mlx-vlm lists empty padding windows too (repeated ends); it drops them before attention.
    assert sorted(set(np.array(mlx_ends).tolist())) == [0, *window_ends]
    assert np.array(mlx_order).tolist() == order.tolist()


@pytest.mark.parametrize(
    ("prompt", "images"),
    [
        (ONE_IMAGE, [(0, (56, 56))]),
        (TWO_IMAGES, [(1, (112, 112)), (2, (84, 56))]),
        (ONE_IMAGE, [(3, (200, 100))]),
        (NO_IMAGE, []),
    ],
    ids=["one-image", "two-images", "wide-image", "no-image"],
)
def test_mlx_vlm_forward_gives_transformers_logits(
    tiny_qwen2_5_vl_dir: Path,
    mlx_vlm_model: Any,
    prompt: str,
    images: list[tuple[int, tuple[int, int]]],
) -> None:
    pictures = [tiny_image(seed, size) for seed, size in images]
    inputs = vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, prompt, pictures)
    logits, positions = _mlx_vlm_logits(mlx_vlm_model, inputs)
    if images:
        hf_model, _, _ = vision_oracles.load_hf_qwen2_5_vl(tiny_qwen2_5_vl_dir)
        hf_positions, _ = hf_model.model.get_rope_index(**inputs)
        assert np.array_equal(positions, hf_positions.numpy())
    expected = vision_oracles.qwen2_5_vl_logits(tiny_qwen2_5_vl_dir, prompt, pictures)
    assert logits.shape == expected.shape == (inputs["input_ids"].shape[1], VOCAB_SIZE)
    # float32 rounding: transformers' own float32 logits differ from float64 by ~2e-5 here.
    assert np.abs(logits - expected).max() < 1e-4


def test_mlx_vlm_greedy_agrees_with_transformers(
    tiny_qwen2_5_vl_dir: Path, mlx_vlm_model: Any
) -> None:
    # Its generation loop, KV cache and decode-step positions (rope deltas) included.
    from mlx_vlm.generate.ar import generate_step

    images = [tiny_image(1, (112, 112)), tiny_image(2, (84, 56))]
    inputs = vision_oracles.qwen2_5_vl_inputs(tiny_qwen2_5_vl_dir, TWO_IMAGES, images)
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
    expected = vision_oracles.qwen2_5_vl_generate(
        tiny_qwen2_5_vl_dir, TWO_IMAGES, images, NEW_TOKENS
    )
    assert tokens == expected
