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
