"""transformers float32 references for the vision-language families: the processor's inputs of a
prompt with images (and, for the Qwen-VL families, videos), the prompt's logits and greedy tokens.

The processor classes are named, not found through `AutoProcessor`: importing mlx-vlm's models
patches `AutoProcessor.from_pretrained` process-wide to return mlx-vlm's own processors (MLX
arrays). Gemma 3's inputs carry `token_type_ids` (1 on image tokens), without which transformers
attends causally over images too; its image processor is transformers' PIL one
(`Gemma3ImageProcessorPil`; the default one needs torchvision).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.oracles import _greedy_config, _one_torch_thread


def greedy_new_tokens(
    model: Any, inputs: dict[str, Any], max_new_tokens: int, eos_ids: list[int] | None
) -> list[int]:
    """A multimodal model's greedy new tokens for one prompt's processor `inputs`: exactly
    ``max_new_tokens`` without ``eos_ids``, else up to and including the first of them."""
    import torch

    gen_config = _greedy_config(model, max_new_tokens)
    gen_config.eos_token_id = eos_ids
    with torch.no_grad(), _one_torch_thread():
        out = model.generate(**inputs, generation_config=gen_config)
    new_tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    if eos_ids is None and len(new_tokens) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new_tokens)} tokens, not {max_new_tokens}")
    return new_tokens


@functools.lru_cache(maxsize=4)
def _load_idefics3(model_dir: str, mtime_ns: int) -> tuple[Any, Any, list[int]]:
    import torch
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor

    model = Idefics3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    # Kept aside: generate() would fill an unset end-of-sequence from the model's own config.
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    return model.eval(), Idefics3Processor.from_pretrained(model_dir), eos_ids


def _idefics3(model_dir: str | Path) -> tuple[Any, Any, list[int]]:
    path = Path(model_dir).resolve()
    return _load_idefics3(str(path), (path / "config.json").stat().st_mtime_ns)


def load_hf_idefics3(model_dir: str | Path) -> tuple[Any, Any]:
    """The checkpoint as a float32 `Idefics3ForConditionalGeneration` (eager attention) and
    transformers' `Idefics3Processor`, cached per directory and file version.

    The processor class is named, not found through `AutoProcessor`: importing mlx-vlm's idefics3
    model patches `AutoProcessor.from_pretrained` process-wide to return mlx-vlm's own processor
    (MLX arrays) for every idefics3 directory."""
    model, processor, _ = _idefics3(model_dir)
    return model, processor


def idefics3_inputs(model_dir: str | Path, prompt: str, images: Sequence[Any]) -> Any:
    """The processor's model inputs for one prompt: ``input_ids`` ``[1, tokens]`` with each
    `<image>` of ``prompt`` expanded to its tiles' tokens, and for images ``pixel_values``
    ``[1, tiles, 3, H, W]`` and ``pixel_attention_mask`` ``[1, tiles, H, W]``. This is the
    processor call vLLM makes for a prompt with ``multi_modal_data={"image": images}``."""
    _, processor = load_hf_idefics3(model_dir)
    if prompt.count("<image>") != len(images):
        raise ValueError(f"{prompt.count('<image>')} <image> in the prompt, {len(images)} images")
    return processor(text=prompt, images=list(images) or None, return_tensors="pt")


def idefics3_prompt_ids(model_dir: str | Path, prompt: str, images: Sequence[Any]) -> list[int]:
    """Prompt token ids after image expansion (what vLLM reports as `prompt_token_ids`)."""
    return idefics3_inputs(model_dir, prompt, images)["input_ids"][0].tolist()


def idefics3_generate(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = False,
) -> list[int]:
    """Greedy new tokens from transformers float32 for one prompt with one `<image>` per image.

    By default end-of-sequence does not stop generation (a vLLM request with ``ignore_eos=True``
    and ``temperature=0``): exactly ``max_new_tokens`` tokens. With ``stop_at_eos`` the list ends
    with the `<end_of_utterance>` id when the model emits it, as vLLM's `token_ids` do.
    """
    model, _, eos_ids = _idefics3(model_dir)
    inputs = idefics3_inputs(model_dir, prompt, images)
    return greedy_new_tokens(model, inputs, max_new_tokens, eos_ids if stop_at_eos else None)


# The Qwen-VL families share everything here but the model class: the image processor (Qwen3-VL
# uses Qwen2-VL's, with its own patch size and limits), the `<|image_pad|>` expansion, the
# `mm_token_type_ids` transformers 5 needs for M-RoPE, and the rope deltas kept on the model.
_QWEN_VL_MODEL_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
_IMAGE_PAD = "<|image_pad|>"


@functools.lru_cache(maxsize=4)
def _load_qwen_vl(family: str, model_dir: str, mtime_ns: int) -> tuple[Any, Any, Any, list[int]]:
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

    model_class = getattr(transformers, _QWEN_VL_MODEL_CLASSES[family])
    model = model_class.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    # Kept aside: generate() would fill an unset end-of-sequence from the model's own config.
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    return model.eval(), image_processor, tokenizer, eos_ids


def _qwen_vl(family: str, model_dir: str | Path) -> tuple[Any, Any, Any, list[int]]:
    path = Path(model_dir).resolve()
    return _load_qwen_vl(family, str(path), (path / "config.json").stat().st_mtime_ns)


def _qwen_vl_inputs(
    family: str,
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    videos: Sequence[Any] = (),
) -> dict[str, Any]:
    import re

    import torch

    from vllm_metal.testing.qwen_vl_video import VIDEO_PAD, video_fields

    _, image_processor, tokenizer, _ = _qwen_vl(family, model_dir)
    for pad, media, kind in ((_IMAGE_PAD, images, "images"), (VIDEO_PAD, videos, "videos")):
        if prompt.count(pad) != len(media):
            raise ValueError(f"{prompt.count(pad)} {pad} in the prompt, {len(media)} {kind}")
    inputs: dict[str, Any] = {}
    expansions: dict[str, list[str]] = {_IMAGE_PAD: [], VIDEO_PAD: []}
    if images:
        pixels = image_processor(images=list(images), return_tensors="pt")
        inputs["pixel_values"] = pixels["pixel_values"].to(torch.float32)
        inputs["image_grid_thw"] = pixels["image_grid_thw"]
        merge = image_processor.merge_size**2
        expansions[_IMAGE_PAD] = [
            _IMAGE_PAD * (int(grid.prod()) // merge) for grid in inputs["image_grid_thw"]
        ]
    if videos:
        fields, expansions[VIDEO_PAD] = video_fields(family, list(videos), image_processor)
        inputs.update(fields)
    queues = {pad: iter(texts) for pad, texts in expansions.items()}
    pads = f"{re.escape(_IMAGE_PAD)}|{re.escape(VIDEO_PAD)}"
    text = re.sub(pads, lambda match: next(queues[match.group(0)]), prompt)
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    image_pad_id = tokenizer.convert_tokens_to_ids(_IMAGE_PAD)
    video_pad_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    token_types = (input_ids == image_pad_id).to(torch.int32)
    token_types += 2 * (input_ids == video_pad_id).to(torch.int32)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": token_types,
        **inputs,
    }


def _qwen_vl_logits(
    family: str,
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    videos: Sequence[Any] = (),
) -> np.ndarray:
    import torch

    model, _, _, _ = _qwen_vl(family, model_dir)
    inputs = _qwen_vl_inputs(family, model_dir, prompt, images, videos)
    with torch.no_grad(), _one_torch_thread():
        logits = model(**inputs, use_cache=False).logits[0]
    # The forward keeps the prompt's rope deltas for decode steps; a later call on the cached
    # model must not inherit them.
    model.model.rope_deltas = None
    return logits.float().numpy()


def _qwen_vl_generate(
    family: str,
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    stop_at_eos: bool,
    videos: Sequence[Any] = (),
) -> list[int]:
    model, _, _, eos_ids = _qwen_vl(family, model_dir)
    inputs = _qwen_vl_inputs(family, model_dir, prompt, images, videos)
    return greedy_new_tokens(model, inputs, max_new_tokens, eos_ids if stop_at_eos else None)


def load_hf_qwen2_5_vl(model_dir: str | Path) -> tuple[Any, Any, Any]:
    """The checkpoint as a float32 `Qwen2_5_VLForConditionalGeneration` (eager attention),
    transformers' PIL `Qwen2VLImageProcessorPil` and its tokenizer, cached per directory and file
    version.

    There is no `Qwen2_5_VLProcessor`: its video processor needs torchvision (which must stay
    absent here), and transformers 5.19 refuses ``video_processor=None`` too (its argument check
    fails with an AttributeError on `VIDEO_PROCESSOR_MAPPING`). `qwen2_5_vl_inputs` does the
    processor's work itself. Classes are named, not found through `AutoProcessor`, because
    importing mlx-vlm's Qwen2.5-VL model patches `AutoProcessor.from_pretrained` process-wide."""
    model, image_processor, tokenizer, _ = _qwen_vl("qwen2_5_vl", model_dir)
    return model, image_processor, tokenizer


def qwen2_5_vl_inputs(
    model_dir: str | Path, prompt: str, images: Sequence[Any], videos: Sequence[Any] = ()
) -> dict[str, Any]:
    """The model inputs `Qwen2_5_VLProcessor` makes for one prompt with one `<|image_pad|>` per
    image (usually as ``<|vision_start|><|image_pad|><|vision_end|>``), as torch tensors:

    - ``input_ids`` and ``attention_mask`` ``[1, tokens]``, with the i-th `<|image_pad|>`
      repeated ``t*h*w / 4`` times (``image_grid_thw[i]``, 2x2 patches per token);
    - ``mm_token_type_ids`` ``[1, tokens]``: 1 at image tokens, else 0. transformers 5 computes
      the M-RoPE positions of the image tokens only when it is given, and otherwise silently
      numbers every token as text;
    - with images, ``pixel_values`` ``[patches, 3*2*14*14]`` float32 (the images' patches one
      after the other, each image's ``t*h*w`` rows) and ``image_grid_thw`` ``[images, 3]``.

    ``videos`` (`qwen_vl_video.Video`, one per `<|video_pad|>`) add ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts``, with their tokens marked 2 in
    ``mm_token_type_ids`` (built as `qwen_vl_video` describes).
    """
    return _qwen_vl_inputs("qwen2_5_vl", model_dir, prompt, images, videos)


def qwen2_5_vl_prompt_ids(model_dir: str | Path, prompt: str, images: Sequence[Any]) -> list[int]:
    """Prompt token ids after image expansion (what vLLM reports as `prompt_token_ids`)."""
    return qwen2_5_vl_inputs(model_dir, prompt, images)["input_ids"][0].tolist()


def qwen2_5_vl_logits(
    model_dir: str | Path, prompt: str, images: Sequence[Any], videos: Sequence[Any] = ()
) -> np.ndarray:
    """Float32 next-token logits ``[tokens, vocab]`` of one forward over the expanded prompt
    (no KV cache), with M-RoPE positions from the image grids."""
    return _qwen_vl_logits("qwen2_5_vl", model_dir, prompt, images, videos)


def qwen2_5_vl_generate(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = False,
    videos: Sequence[Any] = (),
) -> list[int]:
    """Greedy new tokens from transformers float32 for one prompt with one `<|image_pad|>` per
    image.

    By default end-of-sequence does not stop generation (a vLLM request with ``ignore_eos=True``
    and ``temperature=0``): exactly ``max_new_tokens`` tokens. With ``stop_at_eos`` the list ends
    with the end-of-sequence id (`<|im_end|>` or `<|endoftext|>`) when the model emits one, as
    vLLM's `token_ids` do.
    """
    return _qwen_vl_generate(
        "qwen2_5_vl", model_dir, prompt, images, max_new_tokens, stop_at_eos, videos
    )


def load_hf_qwen3_vl(model_dir: str | Path) -> tuple[Any, Any, Any]:
    """The checkpoint as a float32 `Qwen3VLForConditionalGeneration` (eager attention),
    transformers' PIL `Qwen2VLImageProcessorPil` (Qwen3-VL's image processor) and its tokenizer,
    cached per directory and file version.

    As for Qwen2.5-VL (`load_hf_qwen2_5_vl`) there is no `Qwen3VLProcessor`, whose video processor
    needs torchvision; `qwen3_vl_inputs` does the processor's work itself."""
    model, image_processor, tokenizer, _ = _qwen_vl("qwen3_vl", model_dir)
    return model, image_processor, tokenizer


def qwen3_vl_inputs(
    model_dir: str | Path, prompt: str, images: Sequence[Any], videos: Sequence[Any] = ()
) -> dict[str, Any]:
    """The model inputs `Qwen3VLProcessor` makes for one prompt with one `<|image_pad|>` per image,
    as torch tensors: those of `qwen2_5_vl_inputs` (``mm_token_type_ids`` included, without which
    transformers 5 numbers image tokens as text), with ``pixel_values`` ``[patches, 3*2*16*16]``
    (Qwen3-VL's 16x16 patches) and ``image_grid_thw`` ``[images, 3]``; ``videos`` as there, each
    `<|video_pad|>` written as one timestamped run per grid step (no ``second_per_grid_ts``)."""
    return _qwen_vl_inputs("qwen3_vl", model_dir, prompt, images, videos)


def qwen3_vl_prompt_ids(model_dir: str | Path, prompt: str, images: Sequence[Any]) -> list[int]:
    """Prompt token ids after image expansion (what vLLM reports as `prompt_token_ids`)."""
    return qwen3_vl_inputs(model_dir, prompt, images)["input_ids"][0].tolist()


def qwen3_vl_logits(
    model_dir: str | Path, prompt: str, images: Sequence[Any], videos: Sequence[Any] = ()
) -> np.ndarray:
    """Float32 next-token logits ``[tokens, vocab]`` of one forward over the expanded prompt
    (no KV cache), with interleaved M-RoPE positions from the image grids and the DeepStack
    features added after the first decoder layers."""
    return _qwen_vl_logits("qwen3_vl", model_dir, prompt, images, videos)


def qwen3_vl_generate(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    *,
    stop_at_eos: bool = False,
    videos: Sequence[Any] = (),
) -> list[int]:
    """Greedy new tokens from transformers float32 for one prompt with one `<|image_pad|>` per
    image; ``stop_at_eos`` as in `qwen2_5_vl_generate` (by default exactly ``max_new_tokens``)."""
    return _qwen_vl_generate(
        "qwen3_vl", model_dir, prompt, images, max_new_tokens, stop_at_eos, videos
    )


@functools.lru_cache(maxsize=2)
def _load(model_dir: str, mtime_ns: int) -> tuple[Any, Any, list[int]]:
    import torch
    from transformers import (
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        PreTrainedTokenizerFast,
    )

    model = Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    # Kept aside: generate() would fill an unset end-of-sequence from the model's own config.
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(model_dir),
        tokenizer=PreTrainedTokenizerFast.from_pretrained(model_dir),
        image_seq_length=model.config.mm_tokens_per_image,
    )
    return model.eval(), processor, eos_ids


def _gemma3(model_dir: str | Path) -> tuple[Any, Any, list[int]]:
    path = Path(model_dir).resolve()
    return _load(str(path), (path / "config.json").stat().st_mtime_ns)


def gemma3_inputs(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    processor_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The processor's model inputs for one prompt with one `<start_of_image>` per image:
    ``input_ids`` and ``token_type_ids`` ``[1, tokens]`` (each `<start_of_image>` expanded to the
    image's full token sequence) and for images ``pixel_values`` ``[crops, 3, S, S]`` (one crop
    per image unless ``processor_kwargs`` ask for pan-and-scan: ``do_pan_and_scan`` ...)."""
    _, processor, _ = _gemma3(model_dir)
    boi = processor.tokenizer.boi_token
    if prompt.count(boi) != len(images):
        raise ValueError(f"{prompt.count(boi)} {boi} in the prompt, {len(images)} images")
    return dict(
        processor(text=[prompt], images=[list(images)] if images else None, return_tensors="pt")
    )


def gemma3_logits(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    processor_kwargs: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """float32 logits of every prompt token (`[tokens, vocab]`)."""
    import torch

    model, _, _ = _gemma3(model_dir)
    inputs = gemma3_inputs(model_dir, prompt, images, processor_kwargs)
    with torch.no_grad(), _one_torch_thread():
        return model(**inputs, use_cache=False).logits[0].float().numpy()


def gemma3_generate(
    model_dir: str | Path,
    prompt: str,
    images: Sequence[Any],
    max_new_tokens: int,
    processor_kwargs: Mapping[str, Any] | None = None,
    *,
    stop_at_eos: bool = False,
) -> list[int]:
    """Greedy new tokens; by default exactly ``max_new_tokens`` (end-of-sequence ignored), with
    ``stop_at_eos`` ending with the end-of-sequence id when the model emits it."""
    model, _, eos_ids = _gemma3(model_dir)
    inputs = gemma3_inputs(model_dir, prompt, images, processor_kwargs)
    return greedy_new_tokens(model, inputs, max_new_tokens, eos_ids if stop_at_eos else None)
