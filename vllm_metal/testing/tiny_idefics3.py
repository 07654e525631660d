"""A tiny random-weight Idefics3 (SmolVLM-style) vision-language checkpoint and synthetic test
images, for image tests that cannot download models.

Idefics3 is the vision-language family that runs here without torchvision: transformers' PIL image
processor, vLLM's own CPU backend and mlx-vlm's `idefics3` model all load it. The directory holds
config.json, generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json
(with the chat template), special_tokens_map.json, chat_template.jinja, preprocessor_config.json
and processor_config.json, in the layout of published SmolVLM checkpoints.

Model: a SigLIP-style vision tower (2 layers, width 64, 2 heads) sees 32x32 tiles in 8x8 patches
(16 patches); the connector's pixel shuffle (scale factor 2) folds them into 4 embeddings of a
Llama text model (2 layers, width 256, 4 query heads and 2 KV heads of 64 dimensions, rope_theta
1e4 written out in `text_config` for mlx-vlm). Head size 64 because vLLM's CPU attention rejects 16
and is not exact at 32 (see FACTS.md); mlx-vlm derives the head size from width / heads.

Images: the image processor resizes the longest edge to 64 and, with image splitting on, cuts the
picture into 32x32 tiles plus a 32x32 global view. A 64x64 image is 2x2 tiles + global = 5 tiles,
20 image embeddings, and its one `<image>` in the prompt becomes 34 tokens:

    (<fake_token_around_image> <row_R_col_C> <image>*4) for C=1,2, then "\\n"   (rows R=1,2)
    "\\n" <fake_token_around_image> <global-img> <image>*4 <fake_token_around_image>

Tokenizer: the byte-level BPE of `tiny_tokenizer.py` (768 ids, ChatML tokens included), then the
Idefics3 tokens as special added tokens with fixed ids (`image_token_ids()`): 768
`<fake_token_around_image>`, 769 `<image>`, 770 `<end_of_utterance>` (end of sequence), 771
`<global-img>`, 772-807 `<row_1_col_1>` ... `<row_6_col_6>`. The chat template writes SmolVLM's
`<|im_start|>User:<image> text<end_of_utterance>\\nAssistant:` format.

Weights are redrawn wider than transformers' 0.02 init (see `WeightInit`) so that greedy tokens
clearly depend on the image: with the default seed, different images give different continuations,
none of them emits image markup tokens, and `<end_of_utterance>` ends some answers early (after
the one-image chat prompt: `tiny_image(3)` after 19 tokens, `tiny_image(5)` after 8) while others
run on (`tiny_image(0)`: no end within 32 tokens).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_metal.testing.checkpoint_cli import write_checkpoint_main
from vllm_metal.testing.tiny_tokenizer import (
    BOS_TOKEN,
    PAD_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer_json,
    token_id,
    tokenizer_files,
)

if TYPE_CHECKING:
    from PIL import Image

DTYPES = ("float32", "float16", "bfloat16")

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
END_OF_UTTERANCE = "<end_of_utterance>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
MAX_GRID = 6  # the processor looks up <row_i_col_j> for i, j in 1..6

# Vision tower and image processing: 32x32 tiles of 8x8 patches, pixel shuffle by 2 -> 4 tokens.
TILE_SIZE = 32
PATCH_SIZE = 8
SCALE_FACTOR = 2
LONGEST_EDGE = 64  # images are resized to this longest edge, then cut into tiles
IMAGE_SEQ_LEN = (TILE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2


def image_tokens() -> list[str]:
    """The Idefics3 tokens in id order, directly after the tiny BPE vocabulary."""
    grid = [f"<row_{i}_col_{j}>" for i in range(1, MAX_GRID + 1) for j in range(1, MAX_GRID + 1)]
    return [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE, GLOBAL_IMAGE_TOKEN, *grid]


def image_token_ids() -> dict[str, int]:
    """Id of each Idefics3 token."""
    return {token: TOKENIZER_VOCAB_SIZE + i for i, token in enumerate(image_tokens())}


VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(image_tokens())
IMAGE_TOKEN_ID = image_token_ids()[IMAGE_TOKEN]
END_OF_UTTERANCE_ID = image_token_ids()[END_OF_UTTERANCE]


def prompt_tokens_per_image(rows: int, cols: int) -> int:
    """Prompt length of one expanded `<image>` split into ``rows`` x ``cols`` tiles (0, 0: unsplit).

    The tiny BPE has no merged "\\n\\n" token, so the blank line before the global view is two."""
    global_view = 3 + IMAGE_SEQ_LEN  # fake, global-img, images, fake
    if rows == 0 and cols == 0:
        return global_view
    return rows * (cols * (2 + IMAGE_SEQ_LEN) + 1) + 1 + global_view


# --------------------------------------------------------------------------------------------------
# Tokenizer and processor files
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def build_idefics3_tokenizer_json() -> str:
    """The tiny tokenizer with the Idefics3 tokens appended as special added tokens."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(build_tokenizer_json())
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in image_tokens()]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer.to_str()


# SmolVLM's conversation format: `<|im_start|>` once, then "User:" / "Assistant:" turns, each
# ended by <end_of_utterance>. Content may be a string (vLLM then writes `<image>` into the text
# itself) or a list of OpenAI-style parts ({"type": "image"} / {"type": "text", "text": ...}).
CHAT_TEMPLATE = """\
{{- '<|im_start|>' -}}
{%- for message in messages -%}
    {{- message['role'] | capitalize -}}
    {%- if message['content'] is string -%}
        {{- ': ' + message['content'] -}}
    {%- else -%}
        {{- ':' -}}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or part['type'] == 'image_url' -%}
                {{- '<image>' -}}
            {%- elif part['type'] == 'text' -%}
                {{- ' ' + part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<end_of_utterance>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'Assistant:' -}}
{%- endif -%}
"""


def processor_files() -> dict[str, Any]:
    """Tokenizer, image processor and processor files of the checkpoint, keyed by file name."""
    files = tokenizer_files(build_idefics3_tokenizer_json())
    extra_specials = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, END_OF_UTTERANCE]
    eos = {"eos_token": END_OF_UTTERANCE, "additional_special_tokens": extra_specials}
    files["tokenizer_config.json"].update(
        eos, processor_class="Idefics3Processor", chat_template=CHAT_TEMPLATE
    )
    files["special_tokens_map.json"].update(eos)
    preprocessor_config = {
        "image_processor_type": "Idefics3ImageProcessor",
        "processor_class": "Idefics3Processor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"longest_edge": LONGEST_EDGE},
        "resample": 1,  # Lanczos, as SmolVLM
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": TILE_SIZE},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
    }
    processor_config = {"image_seq_len": IMAGE_SEQ_LEN, "processor_class": "Idefics3Processor"}
    return {
        **files,
        "chat_template.jinja": CHAT_TEMPLATE,
        "preprocessor_config.json": preprocessor_config,
        "processor_config.json": processor_config,
    }


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of the two towers."""

    text_hidden: int = 256
    text_intermediate: int = 512
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    vision_hidden: int = 64
    vision_intermediate: int = 128
    vision_layers: int = 2
    vision_heads: int = 2


ROPE_THETA = 10000.0


def tiny_idefics3_config(dtype: str = "float32", size: ModelSize | None = None) -> dict[str, Any]:
    """The config.json contents. `rope_theta` is written into `text_config` as well as
    `rope_parameters`: mlx-vlm reads only the former and otherwise silently uses 1e6."""
    size = ModelSize() if size is None else size
    if size.text_hidden % size.text_heads:
        raise ValueError("text_hidden must be a multiple of text_heads")
    ids = image_token_ids()
    pad_id, bos_id = token_id(PAD_TOKEN), token_id(BOS_TOKEN)
    version = importlib.metadata.version("transformers")
    text_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": size.text_hidden,
        "intermediate_size": size.text_intermediate,
        "num_hidden_layers": size.text_layers,
        "num_attention_heads": size.text_heads,
        "num_key_value_heads": size.text_kv_heads,
        "head_dim": size.text_hidden // size.text_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": ids[END_OF_UTTERANCE],
        "pad_token_id": pad_id,
        "initializer_range": 0.02,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "idefics3_vision",
        "hidden_size": size.vision_hidden,
        "intermediate_size": size.vision_intermediate,
        "num_hidden_layers": size.vision_layers,
        "num_attention_heads": size.vision_heads,
        "num_channels": 3,
        "image_size": TILE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "image_token_id": ids[IMAGE_TOKEN],
        "scale_factor": SCALE_FACTOR,
        "vocab_size": VOCAB_SIZE,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": ids[END_OF_UTTERANCE],
        "pad_token_id": pad_id,
        "text_config": text_config,
        "vision_config": vision_config,
        "dtype": dtype,
        "torch_dtype": dtype,
        "transformers_version": version,
    }


@dataclass(frozen=True)
class WeightInit:
    """Spreads of the redrawn weights: normal around 0 (norm scales: around 1).

    Matrices of both towers are drawn at `matrix_std`, far wider than transformers' 0.02 init,
    so each layer mixes its inputs strongly and the continuation depends on every image tile.
    The connector is narrower: it maps 256 vision features into the text stream, and at full
    width its outputs would be ~16x louder than the text embeddings. Text embeddings stay at the
    Llama default of the other tiny checkpoints (`tiny_models.py`), which varies the greedy
    continuations without collapsing to one repeated token. The output rows of the image markup
    tokens (`<image>`, `<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>`) are narrow,
    so greedy decoding never emits them; the `<end_of_utterance>` row is wider than the others,
    so some images end their answer early and others run to the token limit.
    """

    matrix_std: float = 0.3
    connector_std: float = 0.05
    embed_std: float = 0.3
    position_std: float = 0.5  # the vision tower's learned patch positions
    bias_std: float = 0.1
    norm_std: float = 0.1  # norm scales ~ 1 + N(0, norm_std)
    markup_head_std: float = 0.01  # lm_head rows of the image markup tokens
    eos_head_std: float = 0.6  # lm_head row of <end_of_utterance>


def _redraw_weights(model: Any, seed: int, init: WeightInit) -> None:
    """Redraw every parameter of ``model`` from ``seed`` (in named-parameter order)."""
    import torch

    markup = [i for t, i in image_token_ids().items() if t != END_OF_UTTERANCE]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + init.norm_std * noise)
            elif name.endswith(".bias"):
                param.copy_(init.bias_std * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(init.embed_std * noise)
            elif name.endswith("position_embedding.weight"):
                param.copy_(init.position_std * noise)
            elif ".connector." in name:
                param.copy_(init.connector_std * noise)
            elif name == "lm_head.weight":
                param.copy_(init.matrix_std * noise)
                param[markup] = init.markup_head_std * noise[markup]
                param[END_OF_UTTERANCE_ID] = init.eos_head_std * noise[END_OF_UTTERANCE_ID]
            else:
                param.copy_(init.matrix_std * noise)


def write_tiny_idefics3(
    out_dir: str | Path,
    dtype: str = "float32",
    seed: int = 0,
    *,
    size: ModelSize | None = None,
    init: WeightInit | None = None,
) -> Path:
    """Write the random-weight Idefics3 checkpoint to ``out_dir`` and return it.

    Weights are drawn in float32 from ``seed`` with the spreads of ``init`` (default
    `WeightInit()`) and stored as ``dtype``; the same arguments always give the same files.
    """
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    config_dict = tiny_idefics3_config(dtype, size)
    config = Idefics3Config(**{k: v for k, v in config_dict.items() if k != "transformers_version"})
    torch_dtype = getattr(torch, dtype)
    model = Idefics3ForConditionalGeneration(config)
    _redraw_weights(model, seed, WeightInit() if init is None else init)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch_dtype).save_pretrained(out, safe_serialization=True)
    # Our config.json, not transformers': it keeps `rope_theta` in text_config (see above).
    generation_config = {
        "bos_token_id": config_dict["bos_token_id"],
        "eos_token_id": config_dict["eos_token_id"],
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


# --------------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------------


def tiny_image(seed: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    """A deterministic RGB test image of ``size`` (width, height), clearly different per ``seed``:
    a random background colour, a few filled rectangles and ellipses, and mild pixel noise."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, 0x1DEF])
    width, height = size
    image = Image.new("RGB", size, tuple(int(c) for c in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x0, x1 = sorted(rng.integers(0, width, 2).tolist())
        y0, y1 = sorted(rng.integers(0, height, 2).tolist())
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x1 + 1, y1 + 1), fill=colour)
    pixels = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_idefics3", "Idefics3", write_tiny_idefics3, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
