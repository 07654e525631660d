"""Reference outputs for tests: transformers float32 greedy tokens and logprobs, mlx-lm greedy,
the hidden states and classifier logits pooling models are checked against, and Whisper's greedy
transcriptions of audio clips.

HF runs eager attention, the only HF path that applies Gemma2's attention soft-capping. With a
LoRA adapter, the transformers oracle is PEFT's merged model (`merge_and_unload`) and the mlx-lm
one is mlx-lm's own `LoRALinear` over the loaded (possibly quantized) projections.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=8)
def _load(model_dir: str, mtime_ns: int, adapter_dir: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if model_dir.endswith(".gguf"):  # transformers' own GGUF loading (dequantized to float32)
        kwargs["gguf_file"] = Path(model_dir).name
        model_dir = str(Path(model_dir).parent)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    # generate() fills unset fields from the model's own generation config, so end-of-sequence
    # has to be removed there for greedy runs of a fixed length.
    model.generation_config.eos_token_id = None
    return model.eval()


def load_hf_model(model_dir: str | Path, adapter: str | Path | None = None) -> Any:
    """The checkpoint as a float32 transformers model (cached per directory and file version),
    with the PEFT `adapter` merged into its weights if given. A `.gguf` file is loaded by
    transformers' GGUF support (`gguf_file=`)."""
    path = Path(model_dir).resolve()
    adapter_dir = None if adapter is None else str(Path(adapter).resolve())
    stamp = path if path.is_file() else path / "config.json"
    return _load(str(path), stamp.stat().st_mtime_ns, adapter_dir)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    # Tiny shapes gain nothing from intra-op threads, and on a busy 2-core host the thread pool's
    # waits made a forward several times slower.
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _greedy_config(model: Any, max_new_tokens: int) -> Any:
    """A copy of the model's generation config for greedy search of `max_new_tokens` tokens."""
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.do_sample = False
    gen_config.num_beams = 1
    gen_config.max_new_tokens = max_new_tokens
    gen_config.min_new_tokens = None
    gen_config.temperature = None
    gen_config.top_p = None
    gen_config.top_k = None
    return gen_config


def hf_greedy(
    model_dir: str | Path,
    prompts_token_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    adapter: str | Path | None = None,
) -> list[list[int]]:
    """Greedy continuations of exactly ``max_new_tokens`` tokens for each prompt.

    End-of-sequence tokens neither stop generation nor are masked out, which is what a vLLM
    request with ``ignore_eos=True`` and ``temperature=0`` produces. ``adapter``: a PEFT LoRA
    directory, merged into the weights.
    """
    import torch

    model = load_hf_model(model_dir, adapter)
    gen_config = _greedy_config(model, max_new_tokens)
    gen_config.eos_token_id = None
    results = []
    for prompt in prompts_token_ids:
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        input_ids = torch.tensor([list(prompt)], dtype=torch.long)
        with torch.no_grad(), _one_torch_thread():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=gen_config,
            )
        new_tokens = out[0, len(prompt) :].tolist()
        if len(new_tokens) != max_new_tokens:
            raise RuntimeError(f"generate returned {len(new_tokens)} tokens, not {max_new_tokens}")
        results.append(new_tokens)
    return results


def hf_logits(model_dir: str | Path, token_ids: Sequence[int]) -> np.ndarray:
    """Float32 next-token logits ``[len(token_ids), vocab]`` of one forward over the sequence."""
    import torch

    model = load_hf_model(model_dir)
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.no_grad(), _one_torch_thread():
        logits = model(input_ids, use_cache=False).logits[0]
    return logits.float().numpy()


def hf_logprobs(model_dir: str | Path, token_ids: Sequence[int]) -> np.ndarray:
    """Float32 log-softmax of the next-token logits at each position: ``[len(token_ids), vocab]``.

    Row ``i`` is the distribution of the token after ``token_ids[: i + 1]``.
    """
    logits = hf_logits(model_dir, token_ids).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return logprobs.astype(np.float32)


@functools.lru_cache(maxsize=8)
def _load_pooling(model_dir: str, mtime_ns: int, head: bool) -> Any:
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if head else AutoModel
    return auto.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _pooling_model(model_dir: str | Path, head: bool) -> Any:
    path = Path(model_dir).resolve()
    return _load_pooling(str(path), (path / "config.json").stat().st_mtime_ns, head)


def _inputs(token_ids: Sequence[int], token_type_ids: Sequence[int] | None) -> dict[str, Any]:
    import torch

    inputs = {"input_ids": torch.tensor([list(token_ids)], dtype=torch.long)}
    if token_type_ids is not None:
        inputs["token_type_ids"] = torch.tensor([list(token_type_ids)], dtype=torch.long)
    return inputs


def hf_hidden_states(
    model_dir: str | Path, token_ids: Sequence[int], token_type_ids: Sequence[int] | None = None
) -> np.ndarray:
    """Float32 final hidden states ``[len(token_ids), hidden]`` of the checkpoint's base model
    (`AutoModel`: a decoder after its final norm, an encoder's last layer), one sequence."""
    import torch

    model = _pooling_model(model_dir, head=False)
    with torch.no_grad(), _one_torch_thread():
        hidden = model(**_inputs(token_ids, token_type_ids)).last_hidden_state[0]
    return hidden.float().numpy()


def load_hf_classifier(model_dir: str | Path) -> Any:
    """The checkpoint as a float32 `AutoModelForSequenceClassification` (cached)."""
    return _pooling_model(model_dir, head=True)


def hf_classifier_logits(
    model_dir: str | Path, token_ids: Sequence[int], token_type_ids: Sequence[int] | None = None
) -> np.ndarray:
    """Float32 logits ``[num_labels]`` of `AutoModelForSequenceClassification`, one sequence."""
    import torch

    model = _pooling_model(model_dir, head=True)
    with torch.no_grad(), _one_torch_thread():
        logits = model(**_inputs(token_ids, token_type_ids)).logits[0]
    return logits.float().numpy()


def mlx_lm_greedy(
    model_dir: str | Path,
    prompts_token_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    dtype: str | None = None,
    adapter: str | Path | None = None,
) -> list[list[int]]:
    """Greedy continuations from stock mlx-lm (its own model classes, caches and generate loop).

    ``dtype`` (e.g. ``"float32"``) casts the loaded weights first; None keeps the checkpoint's.
    ``adapter``: a PEFT LoRA directory, applied through mlx-lm's `LoRALinear` (unfused).
    Like :func:`hf_greedy`, end-of-sequence tokens do not stop generation.
    """
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, _ = load(str(model_dir))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    if adapter is not None:
        apply_peft_with_mlx_lm(model, Path(adapter))
    results = []
    for prompt in prompts_token_ids:
        steps = generate_step(mx.array(list(prompt)), model, max_tokens=max_new_tokens)
        results.append([int(token) for token, _ in steps])
    return results


def apply_peft_with_mlx_lm(model: Any, adapter: Path) -> None:
    """Replace each projection the PEFT adapter changes by mlx-lm's `LoRALinear` over it."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear
    from safetensors.numpy import load_file

    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    replaced = []
    prefix = "base_model.model."
    for key in sorted(k for k in tensors if k.endswith("lora_A.weight")):
        path = key[len(prefix) : -len(".lora_A.weight")]
        a = tensors[key]  # [r, in]
        b = tensors[key.replace("lora_A", "lora_B")]  # [out, r]
        rank = config.get("rank_pattern", {}).get(path.split(".")[-1], config["r"])
        alpha = config["lora_alpha"]
        scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
        layer = LoRALinear.from_base(modules[path], r=rank, scale=scale)
        layer.lora_a = mx.array(a.T)
        layer.lora_b = mx.array(b.T)
        replaced.append((path, layer))
    model.update_modules(tree_unflatten(replaced))


@functools.lru_cache(maxsize=4)
def _load_whisper(model_dir: str, mtime_ns: int) -> tuple[Any, Any]:
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval(), WhisperFeatureExtractor.from_pretrained(model_dir)


def load_hf_whisper(model_dir: str | Path) -> tuple[Any, Any]:
    """The checkpoint as a float32 `WhisperForConditionalGeneration` (eager attention) and its
    `WhisperFeatureExtractor`, cached per directory and file version."""
    path = Path(model_dir).resolve()
    return _load_whisper(str(path), (path / "config.json").stat().st_mtime_ns)


def whisper_features(model_dir: str | Path, clip: np.ndarray, sample_rate: int = 16000) -> Any:
    """Log-mel input features ``[1, mel bins, 3000]`` of one clip, padded or cut to 30 s by the
    checkpoint's feature extractor (what vLLM's Whisper processor does with an audio item)."""
    import torch

    _, feature_extractor = load_hf_whisper(model_dir)
    features = feature_extractor(
        np.asarray(clip, dtype=np.float32),
        sampling_rate=sample_rate,
        truncation=True,
        return_tensors="pt",
    ).input_features
    return features.to(torch.float32)


def whisper_generate(
    model_dir: str | Path,
    clips: Sequence[np.ndarray],
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    sample_rate: int = 16000,
) -> list[list[int]]:
    """Greedy Whisper transcriptions from transformers float32, one clip at a time.

    ``prompt_ids`` is the whole decoder prompt, e.g. the ids of
    `<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`; it is fed as `decoder_input_ids`,
    so Whisper's `generate` neither detects a language nor adds or suppresses tokens (no
    timestamp rules, no suppress lists). Returns only the new tokens: at most ``max_new_tokens``,
    ending with the `<|endoftext|>` id when the model stops by itself. That is what vLLM puts in
    `CompletionOutput.token_ids` for a greedy request with ``max_tokens=max_new_tokens`` (checked
    against vLLM 0.32's CPU backend): the EOS id is included there, only the text leaves it out.
    Prompt and new tokens together must fit the model's 448 decoder positions.
    """
    import torch

    model, _ = load_hf_whisper(model_dir)
    prompt = list(prompt_ids)
    if not prompt:
        raise ValueError("the decoder prompt needs at least one token")
    gen_config = _greedy_config(model, max_new_tokens)
    gen_config.max_length = None
    gen_config.return_timestamps = False
    gen_config.suppress_tokens = None
    gen_config.begin_suppress_tokens = None
    gen_config.forced_decoder_ids = None
    # Full sequences (prompt, new tokens, EOS), not Whisper's post-processed segment tokens, which
    # drop the prompt and a final EOS.
    gen_config.return_dict_in_generate = True
    # Without a language table generate() does not run its own language detection first.
    for field in ("lang_to_id", "task_to_id", "language", "task"):
        if hasattr(gen_config, field):
            delattr(gen_config, field)
    eos = gen_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    results = []
    for clip in clips:
        features = whisper_features(model_dir, clip, sample_rate)
        decoder_input_ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad(), _one_torch_thread():
            out = model.generate(
                features,
                decoder_input_ids=decoder_input_ids,
                generation_config=gen_config,
            )
        tokens = out.sequences[0].tolist()
        if tokens[: len(prompt)] != prompt:
            raise RuntimeError(f"generate did not keep the decoder prompt: {tokens[: len(prompt)]}")
        new_tokens = tokens[len(prompt) :]
        # Batch padding after EOS (pad == EOS in Whisper) is not part of the answer.
        for i, token in enumerate(new_tokens):
            if token in eos_ids:
                new_tokens = new_tokens[: i + 1]
                break
        results.append(new_tokens[:max_new_tokens])
    return results


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
