"""A tiny random-weight Qwen2.5-VL checkpoint, for image tests that cannot download models.

Written in the layout of the published Qwen2.5-VL checkpoints (the one transformers 4.x wrote):
config.json keeps the text model's settings at the root, with M-RoPE given as
``rope_scaling: {"type": "mrope", "mrope_section": [...]}`` and ``rope_theta`` beside it, and
the vision tower in a nested ``vision_config``; the weights are named ``visual.*``, ``model.*``
and ``lm_head.weight``. mlx-vlm 0.7.10's ``qwen2_5_vl`` reads only that layout (it builds its text
config from the root keys and renames ``visual``/``model`` prefixes itself); transformers 5 reads it
too (it folds the root keys into ``text_config``, turns ``rope_scaling`` into ``rope_parameters``,
and renames the weights on load). transformers 5 would save nested ``text_config`` and
``rope_parameters`` and ``model.language_model.*`` weights instead, which mlx-vlm misreads, so the
files are written here by hand. The directory also holds generation_config.json, tokenizer.json,
tokenizer_config.json (with the chat template), special_tokens_map.json, chat_template.jinja and
preprocessor_config.json (a ``Qwen2VLImageProcessor``, which transformers runs with PIL when
torchvision is absent). There is no video processor config: the video processor needs torchvision.

Model: a Qwen2.5-VL vision tower (2 blocks, width 64, 2 heads of 32, SwiGLU width 128) embeds
14x14 patches of two (repeated) frames; block 0 attends within 56x56-pixel windows (4x4 patches),
block 1 (``fullatt_block_indexes: [1]``) over the whole image, and the merger folds 2x2 patches
into one embedding of the Qwen2 text model (2 layers, width 256, 4 query heads and 2 KV heads of
64 = 256 / 4 dimensions, the head size mlx-vlm derives; M-RoPE sections [8, 12, 12] for time,
height and width, summing to 64 / 2; rope_theta 1e4).

Images: the image processor resizes to multiples of 28 pixels with at least 56x56 and at most
112x112 pixels in area (``min_pixels``/``max_pixels``), then cuts 14x14 patches. An image of
H x W pixels after resizing has ``image_grid_thw`` [1, H/14, W/14] and ``H/14 * W/14`` rows of
3*2*14*14 = 1176 values in ``pixel_values``, and its ``<|image_pad|>`` becomes ``H*W/28**2``
tokens: a 56x56 (or 64x64) image is grid [1, 4, 4], 16 patches, 4 tokens, one window; 112x112 is
[1, 8, 8], 64 patches, 16 tokens, four windows; 84x56 (W x H) is [1, 4, 6], 24 patches, 6 tokens,
two windows of unequal size.

Tokenizer: the byte-level BPE of `tiny_tokenizer.py` (768 ids, ChatML tokens included), then
Qwen-VL's tokens as special added tokens with fixed ids (`vl_token_ids()`), in Qwen's order: 768
`<|object_ref_start|>` ... 774 `<|vision_start|>`, 775 `<|vision_end|>`, 776 `<|vision_pad|>`,
777 `<|image_pad|>`, 778 `<|video_pad|>`. End of sequence is ChatML's `<|im_end|>`. The chat
template writes ChatML turns with an image as ``<|vision_start|><|image_pad|><|vision_end|>``
(Qwen's markup, without Qwen's default system prompt).

Weights are redrawn wider than transformers' 0.02 init (see `WeightInit`) so that greedy tokens
clearly depend on the image: with the default seed, different images give different
continuations, none of them emits vision markup tokens, and `<|im_end|>` ends some answers early
(after the one-image chat prompt: `tiny_image(6)` after 11 tokens, `tiny_image(0)` after 23; with
no image after 18) while others run on (`tiny_image(1)`: no end within 32 tokens). They are not
wider still because float32 rounding grows with them: at these spreads transformers' float32
logits are within ~2e-5 of float64 (and of mlx-vlm's), at 0.3 they were ~1e-3 off.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_metal.testing.checkpoint_cli import write_checkpoint_main
from vllm_metal.testing.tiny_idefics3 import tiny_image  # noqa: F401 (the test images)
from vllm_metal.testing.tiny_tokenizer import (
    BOS_TOKEN,
    EOT_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer_json,
    token_id,
    tokenizer_files,
)

DTYPES = ("float32", "float16", "bfloat16")

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# Qwen's own order of its extra tokens (ids 151646-151656 in the real vocabulary).
VL_TOKENS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
)
IMAGE_MARKUP = VISION_START + IMAGE_PAD + VISION_END  # one image in a prompt


def vl_token_ids() -> dict[str, int]:
    """Id of each Qwen-VL token: directly after the tiny BPE vocabulary, in Qwen's order."""
    return {token: TOKENIZER_VOCAB_SIZE + i for i, token in enumerate(VL_TOKENS)}


VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(VL_TOKENS)
VISION_START_ID = vl_token_ids()[VISION_START]
VISION_END_ID = vl_token_ids()[VISION_END]
VISION_PAD_ID = vl_token_ids()[VISION_PAD]
IMAGE_PAD_ID = vl_token_ids()[IMAGE_PAD]
VIDEO_PAD_ID = vl_token_ids()[VIDEO_PAD]
IM_END_ID = token_id(IM_END)
ENDOFTEXT_ID = token_id(EOT_TOKEN)

# Vision tower and image processing.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2  # an image is two identical frames
MERGE_SIZE = 2  # 2x2 patches -> one text-model embedding
FACTOR = PATCH_SIZE * MERGE_SIZE  # resized sides are multiples of this
WINDOW_SIZE = 56  # pixels per window side: 4x4 patches, 2x2 merged embeddings
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # columns of pixel_values
ROPE_THETA = 10000.0


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """The Qwen-VL image processors' ``smart_resize``: (height, width) with the sides rounded to
    multiples of ``factor`` (patch size x merge size) and the area scaled into
    [``min_pixels``, ``max_pixels``], aspect ratio kept. Shared by the Qwen-VL checkpoints here,
    which differ only in the limits and the factor."""
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _resized(height: int, width: int) -> tuple[int, int]:
    """`smart_resize` with this checkpoint's limits: sides rounded to multiples of 28 and the area
    scaled into [MIN_PIXELS, MAX_PIXELS]."""
    return smart_resize(height, width, factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def image_grid_thw(width: int, height: int) -> tuple[int, int, int]:
    """``image_grid_thw`` of an image of ``width`` x ``height`` pixels: (1, rows, columns) of
    14x14 patches after resizing (checked against the processor by the tests)."""
    h_bar, w_bar = _resized(height, width)
    return 1, h_bar // PATCH_SIZE, w_bar // PATCH_SIZE


def image_token_count(width: int, height: int) -> int:
    """How many `<|image_pad|>` tokens an image of ``width`` x ``height`` pixels becomes."""
    t, h, w = image_grid_thw(width, height)
    return t * h * w // MERGE_SIZE**2


# --------------------------------------------------------------------------------------------------
# Tokenizer and processor files
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def build_qwen2_5_vl_tokenizer_json() -> str:
    """The tiny tokenizer with the Qwen-VL tokens appended as special added tokens."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(build_tokenizer_json())
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_TOKENS])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer.to_str()


# ChatML turns; a list content is written part by part, an image as Qwen-VL's markup (the test
# on each part is Qwen2.5-VL's own, so OpenAI-style "image_url" parts count as images too).
# A string content is copied as is: vLLM then writes the image markup into the text itself.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'video' or 'video' in part -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def processor_files() -> dict[str, Any]:
    """Tokenizer and image processor files of the checkpoint, keyed by file name."""
    files = tokenizer_files(build_qwen2_5_vl_tokenizer_json())
    specials = [EOT_TOKEN, IM_START, *VL_TOKENS]
    files["tokenizer_config.json"].update(
        processor_class="Qwen2_5_VLProcessor",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=specials,
    )
    files["special_tokens_map.json"].update(additional_special_tokens=specials)
    # Both spellings of the size limits: transformers 5 reads `size`, older readers (and
    # mlx-vlm's own Qwen processor) `min_pixels`/`max_pixels`.
    preprocessor_config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "resample": 3,  # bicubic, as Qwen2.5-VL
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OpenAI CLIP, as Qwen2.5-VL
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
    }
    return {
        **files,
        "chat_template.jinja": CHAT_TEMPLATE,
        "preprocessor_config.json": preprocessor_config,
    }


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of the two towers, and the text model's M-RoPE split.

    ``mrope_section`` gives how many of the ``head_dim / 2`` rotary frequencies turn with the
    temporal, height and width position (Qwen2.5-VL's own 16/24/24 of 64, scaled to 32).
    """

    text_hidden: int = 256
    text_intermediate: int = 512
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    mrope_section: tuple[int, int, int] = (8, 12, 12)
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_layers: int = 2
    vision_heads: int = 2

    def __post_init__(self) -> None:
        if self.text_hidden % self.text_heads or self.vision_hidden % self.vision_heads:
            raise ValueError("widths must be multiples of the head counts")
        head_dim = self.text_hidden // self.text_heads
        if sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section must sum to head_dim / 2 = {head_dim // 2}")


def tiny_qwen2_5_vl_config(dtype: str = "float32", size: ModelSize | None = None) -> dict[str, Any]:
    """The config.json contents, in the published checkpoints' flat layout (see module docstring).

    ``head_dim`` is not written: transformers and mlx-vlm both take width / heads."""
    size = ModelSize() if size is None else size
    vision_config = {
        "model_type": "qwen2_5_vl",  # mlx-vlm refuses any other vision model_type
        "depth": size.vision_layers,
        "hidden_size": size.vision_hidden,
        "intermediate_size": size.vision_intermediate,
        "num_heads": size.vision_heads,
        "hidden_act": "silu",
        "in_channels": 3,
        "in_chans": 3,
        "out_hidden_size": size.text_hidden,
        "patch_size": PATCH_SIZE,
        "spatial_patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "window_size": WINDOW_SIZE,
        "fullatt_block_indexes": [size.vision_layers - 1],
        "tokens_per_second": 2,
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate,
        "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads,
        "num_key_value_heads": size.text_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": {"type": "mrope", "mrope_section": list(size.mrope_section)},
        "use_sliding_window": False,
        "sliding_window": 2048,
        "max_window_layers": size.text_layers,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": IM_END_ID,
        "pad_token_id": token_id(PAD_TOKEN),
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "vision_token_id": VISION_PAD_ID,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_config": vision_config,
        "torch_dtype": dtype,
        "transformers_version": "4.49.0",  # the layout's, not the installed version
    }


@dataclass(frozen=True)
class WeightInit:
    """Spreads of the redrawn weights: normal around 0 (norm scales: around 1).

    Matrices of both towers are drawn at `matrix_std`, far wider than transformers' 0.02 init,
    so each layer mixes its inputs strongly and the continuation depends on every patch. The
    patch embedding and the merger see many inputs (1176 pixel values, 4 x 64 features) and are
    narrower, so that image embeddings land near the loudness of the text embeddings. The output
    rows of the vision markup tokens are narrow, so greedy decoding does not emit them.
    """

    matrix_std: float = 0.1
    patch_std: float = 0.05
    merger_std: float = 0.05
    embed_std: float = 0.3
    bias_std: float = 0.1
    norm_std: float = 0.1  # norm scales ~ 1 + N(0, norm_std)
    markup_head_std: float = 0.01  # lm_head rows of the Qwen-VL tokens
    eos_head_std: float = 0.25  # lm_head row of <|im_end|>


def _redraw_weights(model: Any, seed: int, init: WeightInit) -> None:
    """Redraw every parameter of ``model`` from ``seed`` (in named-parameter order)."""
    import torch

    markup = list(vl_token_ids().values())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if ("norm" in name or "ln_q" in name) and name.endswith(".weight"):
                param.copy_(1.0 + init.norm_std * noise)
            elif name.endswith(".bias"):
                param.copy_(init.bias_std * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(init.embed_std * noise)
            elif "patch_embed" in name:
                param.copy_(init.patch_std * noise)
            elif ".merger." in name or ".deepstack_merger_list." in name:  # Qwen3-VL has both
                param.copy_(init.merger_std * noise)
            elif name == "lm_head.weight":
                param.copy_(init.matrix_std * noise)
                param[markup] = init.markup_head_std * noise[markup]
                param[IM_END_ID] = init.eos_head_std * noise[IM_END_ID]
            else:
                param.copy_(init.matrix_std * noise)


def _hub_name(name: str) -> str:
    """A transformers 5 parameter name in the published checkpoints' naming."""
    for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def write_tiny_qwen2_5_vl(
    out_dir: str | Path,
    dtype: str = "float32",
    seed: int = 0,
    *,
    size: ModelSize | None = None,
    init: WeightInit | None = None,
) -> Path:
    """Write the random-weight Qwen2.5-VL checkpoint to ``out_dir`` and return it.

    Weights are drawn in float32 from ``seed`` with the spreads of ``init`` (default
    `WeightInit()`) and stored as ``dtype``; the same arguments always give the same files.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    config_dict = tiny_qwen2_5_vl_config(dtype, size)
    # A deep copy: transformers rewrites `rope_scaling` in place into its `rope_parameters`.
    hf_config = copy.deepcopy({k: v for k, v in config_dict.items() if k != "transformers_version"})
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**hf_config))
    _redraw_weights(model, seed, WeightInit() if init is None else init)

    torch_dtype = getattr(torch, dtype)
    tensors = {
        _hub_name(name): param.detach().to(torch_dtype).contiguous()
        for name, param in model.named_parameters()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    generation_config = {
        "bos_token_id": config_dict["bos_token_id"],
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": config_dict["pad_token_id"],
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
        argv, "vllm_metal.testing.tiny_qwen2_5_vl", "Qwen2.5-VL", write_tiny_qwen2_5_vl, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
