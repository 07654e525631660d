"""transformers float32 references for Gemma 3 with images: the processor's inputs, the prompt's
logits and greedy tokens.

The classes are named, not found through the Auto factories: importing mlx-vlm's gemma3 model
patches `AutoProcessor` process-wide to return mlx-vlm's own processor (MLX arrays), and the
image processor is transformers' PIL one (`Gemma3ImageProcessorPil`; the default one needs
torchvision). Inputs carry `token_type_ids` (1 on image tokens), without which transformers
attends causally over images too.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vllm_metal.testing.oracles import _one_torch_thread, greedy_new_tokens


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
