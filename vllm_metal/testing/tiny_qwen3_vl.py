"""A tiny random-weight Qwen3-VL checkpoint (the dense model, not MoE), for image tests that cannot
download models.

Written in the layout of the published Qwen3-VL checkpoints (Qwen/Qwen3-VL-2B-Instruct, written
by transformers 4.57): config.json nests the text model's settings in ``text_config`` (with
``rope_theta`` and ``rope_scaling: {"rope_type": "default", "mrope_section": [...],
"mrope_interleaved": true}`` inside it) and the vision tower's in ``vision_config`` (its
``model_type`` "qwen3_vl"); the weights are named ``model.visual.*``, ``model.language_model.*``
and ``lm_head.weight``, which is also transformers 5's naming. mlx-vlm 0.7.10's ``qwen3_vl``
needs exactly that: it builds its text config from ``text_config`` only when every required
field is there, ``rope_theta`` and ``head_dim`` included (transformers 5 would save
``rope_parameters`` instead, which mlx-vlm cannot read), it accepts no vision ``model_type``
but "qwen3_vl" (transformers renames it to "qwen3_vl_vision" on load), and its ``sanitize``
renames ``model.visual``/``model.language_model``/``lm_head`` itself. transformers 5 reads the
same files, turning ``rope_scaling`` and ``rope_theta`` into ``rope_parameters``. The files are
written here by hand. The directory also holds generation_config.json, the tokenizer files
(with the chat template), chat_template.jinja and preprocessor_config.json (a
``Qwen2VLImageProcessorFast``, as published; transformers loads its PIL twin when torchvision is
absent). There is no video processor config: the video processor needs torchvision.

Model: a Qwen3-VL vision tower (3 blocks, width 64, 2 heads of 32, GELU(tanh) MLP of width 128,
no attention windows) embeds 16x16 patches of two (repeated) frames, adds a learned position
embedding (a 6x6 grid, bilinearly resampled to each image's patch grid), and folds 2x2 patches
into one embedding of the Qwen3 text model (2 layers, width 256, 4 query heads and 2 KV heads of
``head_dim`` 64 with q/k RMS norms; rope_theta 1e4). DeepStack: the outputs of vision blocks 0
and 1 (``deepstack_visual_indexes``) each go through their own 2x2 merger and are added to the
hidden states at the image positions after decoder layers 0 and 1. M-RoPE is interleaved: of the
32 rotary frequencies, 1, 4, ..., 28 turn with the height position, 2, 5, ..., 29 with the width
position and the other 12 with the temporal one (``mrope_section`` [12, 10, 10], Qwen's
[24, 20, 20] halved).

Images: the image processor resizes to multiples of 32 pixels with at least 64x64 and at most
128x128 pixels in area, then cuts 16x16 patches. An image of H x W pixels after resizing has
``image_grid_thw`` [1, H/16, W/16], ``H/16 * W/16`` rows of 3*2*16*16 = 1536 values in
``pixel_values``, and its ``<|image_pad|>`` becomes ``H*W/32**2`` tokens: 64x64 is [1, 4, 4] and
4 tokens, 128x128 is [1, 8, 8] and 16 tokens, 96x64 (W x H) is [1, 4, 6] and 6 tokens.

Tokenizer and chat template are the tiny Qwen2.5-VL checkpoint's (`tiny_qwen2_5_vl`): the same
Qwen-VL tokens with the same ids (`vl_token_ids()`), which Qwen3-VL shares with Qwen2.5-VL.

Weights are redrawn with `tiny_qwen2_5_vl.WeightInit`'s spreads, for the same reasons: greedy
tokens clearly depend on the image, while transformers' float32 logits stay within ~2e-5 of
mlx-vlm's. Only the `<|im_end|>` output row is quieter (`DEFAULT_INIT`), so that with the
default seed some answers end early and others run on: after the one-image chat prompt
`tiny_image(2)` ends after 12 tokens, `tiny_image(4)` after 23 and `tiny_image(7)` after 24,
while `tiny_image(0)` and the text-only prompt give no end within 32 tokens.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_metal.testing.checkpoint_cli import write_checkpoint_main
from vllm_metal.testing.tiny_qwen2_5_vl import (
    DTYPES,
    ENDOFTEXT_ID,
    IM_END_ID,
    IMAGE_MARKUP,  # noqa: F401 (one image in a prompt)
    IMAGE_PAD_ID,
    VIDEO_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    VOCAB_SIZE,
    WeightInit,
    _redraw_weights,
    smart_resize,
    tiny_image,  # noqa: F401 (the test images)
    vl_token_ids,  # noqa: F401
)
from vllm_metal.testing.tiny_qwen2_5_vl import processor_files as _qwen2_5_vl_processor_files
from vllm_metal.testing.tiny_tokenizer import BOS_TOKEN, PAD_TOKEN, token_id

# Vision tower and image processing.
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2  # an image is two identical frames
MERGE_SIZE = 2  # 2x2 patches -> one text-model embedding
FACTOR = PATCH_SIZE * MERGE_SIZE  # resized sides are multiples of this
MIN_PIXELS = 64 * 64
MAX_PIXELS = 128 * 128
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # columns of pixel_values
ROPE_THETA = 10000.0

# `tiny_qwen2_5_vl.WeightInit` with a quieter `<|im_end|>` output row: at Qwen2.5-VL's 0.25 most
# answers here ended within a few tokens (the text-only one after two), at 0.1 none ended.
DEFAULT_INIT = WeightInit(eos_head_std=0.15)


def image_grid_thw(width: int, height: int) -> tuple[int, int, int]:
    """``image_grid_thw`` of an image of ``width`` x ``height`` pixels: (1, rows, columns) of
    16x16 patches after resizing (checked against the processor by the tests)."""
    h_bar, w_bar = smart_resize(
        height, width, factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )
    return 1, h_bar // PATCH_SIZE, w_bar // PATCH_SIZE


def image_token_count(width: int, height: int) -> int:
    """How many `<|image_pad|>` tokens an image of ``width`` x ``height`` pixels becomes."""
    t, h, w = image_grid_thw(width, height)
    return t * h * w // MERGE_SIZE**2


def processor_files() -> dict[str, Any]:
    """Tokenizer and image processor files of the checkpoint, keyed by file name: Qwen2.5-VL's
    tokenizer files naming Qwen3-VL's processor, and Qwen3-VL's image processor settings."""
    files = _qwen2_5_vl_processor_files()
    files["tokenizer_config.json"]["processor_class"] = "Qwen3VLProcessor"
    # Both spellings of the size limits: transformers 5 reads `size`, mlx-vlm's own Qwen3-VL
    # processor either (`min_pixels`/`max_pixels` win there).
    files["preprocessor_config.json"] = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "resample": 3,  # bicubic
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],  # Qwen3-VL's, unlike Qwen2.5-VL's CLIP statistics
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    return files


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of the two towers, the text model's M-RoPE split and the DeepStack levels.

    ``mrope_section`` gives how many of the ``head_dim / 2`` rotary frequencies turn with the
    temporal, height and width position (interleaved, see the module docstring).
    ``deepstack_indexes`` are the vision blocks whose outputs are added, in order, after decoder
    layers 0, 1, ...; so there may be no more of them than decoder layers.
    ``position_grid`` is the side of the learned vision position embedding grid.
    """

    text_hidden: int = 256
    text_intermediate: int = 512
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    head_dim: int = 64
    mrope_section: tuple[int, int, int] = (12, 10, 10)
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_layers: int = 3
    vision_heads: int = 2
    deepstack_indexes: tuple[int, ...] = (0, 1)
    position_grid: int = 6

    def __post_init__(self) -> None:
        if self.vision_hidden % self.vision_heads:
            raise ValueError("the vision width must be a multiple of its head count")
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(f"mrope_section must sum to head_dim / 2 = {self.head_dim // 2}")
        if len(self.deepstack_indexes) > self.text_layers:
            raise ValueError("more DeepStack levels than decoder layers to receive them")
        if not all(0 <= i < self.vision_layers for i in self.deepstack_indexes):
            raise ValueError("DeepStack indexes must name vision blocks")


def tiny_qwen3_vl_config(dtype: str = "float32", size: ModelSize | None = None) -> dict[str, Any]:
    """The config.json contents, in the published checkpoints' nested layout (see module
    docstring). Settings both readers need sit in ``text_config``; ``tie_word_embeddings`` is
    written at both levels (transformers reads the root, mlx-vlm the text config)."""
    size = ModelSize() if size is None else size
    text_config = {
        "model_type": "qwen3_vl_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate,
        "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads,
        "num_key_value_heads": size.text_kv_heads,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": {
            "rope_type": "default",
            "mrope_section": list(size.mrope_section),
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": IM_END_ID,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "qwen3_vl",  # mlx-vlm refuses transformers' "qwen3_vl_vision"
        "depth": size.vision_layers,
        "hidden_size": size.vision_hidden,
        "intermediate_size": size.vision_intermediate,
        "num_heads": size.vision_heads,
        "hidden_act": "gelu_pytorch_tanh",  # mlx-vlm hard-codes tanh-approximated GELU
        "in_channels": 3,
        "out_hidden_size": size.text_hidden,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "num_position_embeddings": size.position_grid**2,
        "deepstack_visual_indexes": list(size.deepstack_indexes),
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformers_version": "4.57.0",  # the layout's, not the installed version
    }


def write_tiny_qwen3_vl(
    out_dir: str | Path,
    dtype: str = "float32",
    seed: int = 0,
    *,
    size: ModelSize | None = None,
    init: WeightInit | None = None,
) -> Path:
    """Write the random-weight Qwen3-VL checkpoint to ``out_dir`` and return it.

    Weights are drawn in float32 from ``seed`` with the spreads of ``init`` (default
    `DEFAULT_INIT`) and stored as ``dtype``; the same arguments always give the same files.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    config_dict = tiny_qwen3_vl_config(dtype, size)
    # Rebuilt from the file's text: transformers rewrites the nested dicts in place.
    hf_config = json.loads(json.dumps(config_dict))
    del hf_config["transformers_version"], hf_config["architectures"]
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**hf_config))
    _redraw_weights(model, seed, DEFAULT_INIT if init is None else init)

    torch_dtype = getattr(torch, dtype)
    # transformers 5's parameter names are already the published ones.
    tensors = {
        name: param.detach().to(torch_dtype).contiguous()
        for name, param in model.named_parameters()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation_config = {
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": token_id(PAD_TOKEN),
        "do_sample": False,
        "transformers_version": config_dict["transformers_version"],
    }
    files: dict[str, Any] = {
        "config.json": config_dict,
        "generation_config.json": generation_config,
        **processor_files(),
    }
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=2) + "\n"
        (out / name).write_text(text, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_qwen3_vl", "Qwen3-VL", write_tiny_qwen3_vl, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
