"""A tiny random-weight Gemma 3 (vision-language) checkpoint, for image tests that cannot
download models.

Written in the layout of the published Gemma 3 checkpoints (the one transformers 4.50 wrote):
config.json holds a nested ``text_config`` (``gemma3_text``, with ``rope_theta``,
``rope_local_base_freq`` and ``sliding_window_pattern``) and ``vision_config``
(``siglip_vision_model``); weights are named ``language_model.model.*``,
``vision_tower.vision_model.*`` and ``multi_modal_projector.*``. mlx-vlm 0.7.10's ``gemma3`` reads
that layout, and transformers 5 reads it too (renaming the weights on load). The directory also
holds generation_config.json, the tokenizer files (with the chat template),
preprocessor_config.json (a ``Gemma3ImageProcessor``, which runs on PIL) and
processor_config.json.

Model: a SigLIP vision tower (2 layers, width 32, 2 heads) embeds 8x8 patches of a 48x48 image
(6x6 patches); the projector average-pools them 2x2 into 3x3 = 9 embeddings (``mm_tokens_per_image``),
normalises and projects them into the Gemma 3 text model: 4 layers alternating sliding-window
(window 6, shorter than an image's 9 tokens) and global attention, width 64, 2 query heads and
1 KV head of 32, embeddings scaled by sqrt(64) = 8 (exact in every dtype).

Images: every image is resized to 48x48 (no pan-and-scan crops), so each becomes
``\\n\\n<start_of_image>`` + 9 ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` in the prompt. The
9 image tokens attend to each other both ways (transformers' ``token_type_ids`` blocks; vLLM's
``is_mm_prefix_lm``), which the test images make visible in the logits.

Tokenizer: the byte-level BPE of `tiny_tokenizer.py` (768 ids, ChatML tokens included), then
Gemma's three image tokens as special added tokens (768 ``<start_of_image>``, 769
``<end_of_image>``, 770 ``<image_soft_token>``). The chat template writes ChatML turns with an
image as ``<start_of_image>``, which Gemma's processor expands. End of sequence is
``<|im_end|>``.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_metal.testing.checkpoint_cli import save_checkpoint, write_checkpoint_main
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

# float16 is left out: vLLM refuses it for Gemma 3, whose activations overflow it.
DTYPES = ("float32", "bfloat16")

BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
IMAGE_TOKENS = (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN)
BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID = (TOKENIZER_VOCAB_SIZE + i for i in range(3))
VOCAB_SIZE = TOKENIZER_VOCAB_SIZE + len(IMAGE_TOKENS)
IM_END_ID = token_id(IM_END)

IMAGE_SIZE = 48
PATCH_SIZE = 8
TOKENS_PER_IMAGE = 9  # 6x6 patches pooled 2x2
SLIDING_WINDOW = 6


@functools.lru_cache(maxsize=1)
def build_gemma3_tokenizer_json() -> str:
    """The tiny tokenizer with Gemma's image tokens appended as special added tokens."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_str(build_tokenizer_json())
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    return tokenizer.to_str()


# ChatML turns; an image part (OpenAI-style "image_url" too) is written as <start_of_image>, which
# the processor expands into the image's full token sequence.
CHAT_TEMPLATE = """\
{%- for message in messages -%}
    {{- '<|im_start|>' + message['role'] + '\\n' -}}
    {%- if message['content'] is string -%}
        {{- message['content'] -}}
    {%- else -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
                {{- '<start_of_image>' -}}
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
    """Tokenizer and processor files of the checkpoint, keyed by file name."""
    files = tokenizer_files(build_gemma3_tokenizer_json())
    specials = [EOT_TOKEN, IM_START, *IMAGE_TOKENS]
    files["tokenizer_config.json"].update(
        processor_class="Gemma3Processor",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=specials,
        # Gemma3Processor reads these three attributes of its tokenizer.
        extra_special_tokens={
            "boi_token": BOI_TOKEN,
            "eoi_token": EOI_TOKEN,
            "image_token": IMAGE_TOKEN,
        },
        boi_token=BOI_TOKEN,
        eoi_token=EOI_TOKEN,
        image_token=IMAGE_TOKEN,
    )
    files["special_tokens_map.json"].update(additional_special_tokens=specials)
    preprocessor_config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": None,
        "do_resize": True,
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 2,  # bilinear, as Gemma 3
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_ratio_to_activate": None,
    }
    processor_config = {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}
    return {
        **files,
        "chat_template.jinja": CHAT_TEMPLATE,
        "preprocessor_config.json": preprocessor_config,
        "processor_config.json": processor_config,
    }


@dataclass(frozen=True)
class WeightInit:
    """Spreads of the redrawn weights: normal around 0 (Gemma's norms scale by 1 + weight).

    Matrices are far wider than transformers' 0.02 init so that greedy tokens depend on every
    patch; the output rows of the image tokens are narrow, so greedy decoding does not emit them.
    """

    matrix_std: float = 0.15
    patch_std: float = 0.05
    embed_std: float = 0.05  # scaled by sqrt(64) = 8 in the model
    bias_std: float = 0.1
    norm_std: float = 0.1
    image_head_std: float = 0.01  # embedding (= tied head) rows of the image tokens
    eos_head_std: float = 0.2  # ... of <|im_end|>


def tiny_gemma3_config(dtype: str = "float32") -> dict[str, Any]:
    """The config.json contents, in the published checkpoints' layout (module docstring)."""
    text_config = {
        "model_type": "gemma3_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": None,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        # mlx-vlm sizes its projector's pooling from here (the published models leave it at its
        # default, 256, which is also theirs).
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
    }
    vision_config = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "vision_use_head": False,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": vision_config,
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
        "boi_token_index": BOI_TOKEN_ID,
        "eoi_token_index": EOI_TOKEN_ID,
        "image_token_index": IMAGE_TOKEN_ID,
        "bos_token_id": token_id(BOS_TOKEN),
        "eos_token_id": IM_END_ID,
        "pad_token_id": token_id(PAD_TOKEN),
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "transformers_version": "4.50.0",  # the layout's, not the installed version
    }


def _redraw_weights(model: Any, seed: int, init: WeightInit) -> None:
    """Redraw every parameter of ``model`` from ``seed`` (in named-parameter order)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "layernorm" in name or "layer_norm" in name or "post_layernorm" in name:
                # SigLIP's LayerNorms scale by weight; Gemma's RMSNorms by 1 + weight.
                gemma = ".language_model." in f".{name}" or "mm_soft_emb_norm" in name
                base = 0.0 if gemma or name.endswith(".bias") else 1.0
                std = init.bias_std if name.endswith(".bias") else init.norm_std
                param.copy_(base + std * noise)
            elif name.endswith("norm.weight"):  # Gemma RMSNorms (q/k norms, final norm)
                param.copy_(init.norm_std * noise)
            elif name.endswith(".bias"):
                param.copy_(init.bias_std * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(init.embed_std * noise)
                image = [BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID]
                param[image] = init.image_head_std * noise[image]
                param[IM_END_ID] = init.eos_head_std * noise[IM_END_ID]
            elif "patch_embedding" in name or "position_embedding" in name:
                param.copy_(init.patch_std * noise)
            else:
                param.copy_(init.matrix_std * noise)


def _hub_name(name: str) -> str:
    """A transformers 5 parameter name in the published checkpoints' naming."""
    for new, old in (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def write_tiny_gemma3(
    out_dir: str | Path, dtype: str = "float32", seed: int = 0, *, init: WeightInit | None = None
) -> Path:
    """Write the random-weight Gemma 3 checkpoint to ``out_dir`` and return it. Weights are drawn
    in float32 from ``seed`` and stored as ``dtype``; the same arguments give the same files."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
    config_dict = tiny_gemma3_config(dtype)
    hf_config = {k: v for k, v in config_dict.items() if k != "transformers_version"}
    model = Gemma3ForConditionalGeneration(Gemma3Config(**hf_config))
    _redraw_weights(model, seed, WeightInit() if init is None else init)
    tensors = {
        _hub_name(name): param for name, param in model.named_parameters() if "lm_head" not in name
    }
    generation_config = {
        "bos_token_id": config_dict["bos_token_id"],
        "eos_token_id": [IM_END_ID, token_id(EOT_TOKEN)],
        "pad_token_id": config_dict["pad_token_id"],
        "do_sample": False,
        "transformers_version": config_dict["transformers_version"],
    }
    files = {
        "config.json": config_dict,
        "generation_config.json": generation_config,
        **processor_files(),
    }
    return save_checkpoint(out_dir, tensors, dtype, files)


def main(argv: list[str] | None = None) -> int:
    return write_checkpoint_main(
        argv, "vllm_metal.testing.tiny_gemma3", "Gemma 3", write_tiny_gemma3, DTYPES
    )


if __name__ == "__main__":
    sys.exit(main())
