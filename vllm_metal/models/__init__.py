"""Models of the MLX backend: loaders by checkpoint format, adapters by `model_type`.

`load_model` reads a checkpoint with the loader for its format (`loaders/`) and wraps the model in
the adapter for its family (`families/`, the generic `ModelAdapter` otherwise). The runner only
talks to the adapter: embeddings, a forward over hidden states, logits and the layer kinds.
Vision-language models load through mlx-vlm (`loaders/mlx_vlm.py`) into a
`multimodal.MultimodalAdapter`. Encoder-only models (`load_encoder`) have their own adapter, `encoder.EncoderAdapter`, and
speech-to-text models (`load_speech_model`) theirs, `families.whisper.WhisperAdapter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_metal.models.adapter import LayerRange, ModelAdapter
from vllm_metal.models.families import adapter_class
from vllm_metal.models.layers import LayerKind

if TYPE_CHECKING:
    from pathlib import Path

    import mlx.core as mx

    from vllm_metal.models.encoder import EncoderAdapter
    from vllm_metal.models.families.whisper import WhisperAdapter

__all__ = ["LayerKind", "ModelAdapter", "load_encoder", "load_model", "load_speech_model"]


def loads_towers(model: str, model_type: str | None, language_model_only: bool = False) -> bool:
    """Whether `model` loads with its towers: a vision-language family's checkpoint (through
    mlx-vlm), or, for a family whose towers sit beside mlx-lm's language model (Qwen3.5,
    Gemma 4), where its towers run on this host and vLLM takes media items (else mlx-lm's
    language model alone); a GGUF file holds the language model only."""
    from vllm_metal.models.families import model_types, runs_towers, towers_beside_language_model
    from vllm_metal.models.loaders import is_gguf

    if is_gguf(model):
        return False
    if towers_beside_language_model(model_type):
        return not language_model_only and runs_towers(model_type)
    return model_type in model_types("vision_language")


def load_model(
    model: str,
    *,
    compute_dtype: mx.Dtype,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    dequantize: bool = False,
    lm_head: bool = True,
    hf_config: dict[str, Any] | None = None,
    towers: bool | None = None,
    language_model_only: bool = False,
    layers: LayerRange | None = None,
) -> ModelAdapter:
    """Load `model` (a local directory, a Hugging Face id or a `.gguf` file) and wrap it for the
    runner.

    Without `lm_head` (pooling models) the decoder is loaded without its head; `logits` is then
    unavailable and the pooling heads read what they need from the checkpoint. `hf_config`: the
    config vLLM parsed (`--hf-config-path` or the GGUF metadata), which a GGUF file is built from;
    None reads it from the file. Vision-language models (the families of that kind) load
    through mlx-vlm, their adapter a `multimodal.MultimodalAdapter`; a family whose towers sit
    beside the language model (`families.towers_beside_language_model`) loads that through
    mlx-lm, its towers attached to its adapter. `towers`: whether
    to load the towers (None: as `loads_towers` decides, with vLLM's `language_model_only`).
    `layers`: a pipeline stage's share of the decoder layers, the only ones loaded (safetensors
    checkpoints of `families.PIPELINE_STAGE_TYPES`; the startup refuses the others)."""
    from vllm_metal.models.families import towers_beside_language_model
    from vllm_metal.models.loaders import is_gguf, safetensors

    model_type = (hf_config or {}).get("model_type")
    if towers is None:
        towers = loads_towers(model, model_type, language_model_only)
    towers_beside = towers and towers_beside_language_model(model_type) and not is_gguf(model)
    if towers and not towers_beside:
        from vllm_metal.models.loaders import mlx_vlm

        mlx_model, config = mlx_vlm.load(
            model, compute_dtype, revision=revision, download_dir=download_dir
        )
    elif is_gguf(model):
        from vllm_metal.models.loaders import gguf

        mlx_model, config = gguf.load(
            model, compute_dtype, config=hf_config, dequantize=dequantize, lm_head=lm_head
        )
    else:
        mlx_model, config = safetensors.load(
            model,
            compute_dtype,
            revision=revision,
            download_dir=download_dir,
            trust_remote_code=trust_remote_code,
            dequantize=dequantize,
            lm_head=lm_head,
            layers=layers,
        )
        wrapper = config  # a vision-language checkpoint's whole config (its `vision_config`)
        if "language_model" in mlx_model and "model" not in mlx_model:
            # mlx-lm's text-only class of a vision-language checkpoint (`config.multimodal`): its
            # language model is an ordinary mlx-lm model.
            mlx_model, config = mlx_model.language_model, config.get("text_config", config)
    if towers_beside:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        adapter = adapter_class(model_type)(mlx_model, config, wrapper.get("vision_config"))
        adapter.load_towers(
            resolve_model_path(model, revision, download_dir), wrapper, compute_dtype
        )
    else:
        adapter = adapter_class(config.get("model_type"))(mlx_model, config)
    adapter.stage = layers
    adapter.install_paged_attention()
    return adapter


def load_encoder(
    model: str,
    *,
    compute_dtype: mx.Dtype,
    revision: str | None = None,
    download_dir: str | None = None,
) -> EncoderAdapter:
    """Load the encoder-only checkpoint `model` (BERT, RoBERTa, XLM-RoBERTa) for pooling."""
    from vllm_metal.models import encoder

    path, config = _checkpoint(
        model, revision, download_dir, "encoder-only", sorted(encoder.ENCODER_MODEL_TYPES)
    )
    return encoder.load_encoder(path, config, compute_dtype)


def load_speech_model(
    model: str,
    *,
    compute_dtype: mx.Dtype,
    revision: str | None = None,
    download_dir: str | None = None,
) -> WhisperAdapter:
    """Load the speech-to-text checkpoint `model` (Whisper, Hugging Face layout)."""
    from vllm_metal.models.families import whisper

    path, config = _checkpoint(
        model, revision, download_dir, "speech-to-text", list(whisper.MODEL_TYPES)
    )
    return whisper.load(path, config, compute_dtype)


def _checkpoint(
    model: str, revision: str | None, download_dir: str | None, kind: str, served: list[str]
) -> tuple[Path, dict[str, Any]]:
    """The local directory of `model` and its config.json, whose `model_type` must be one of
    `served` (a ValueError naming the model otherwise)."""
    import json

    from vllm_metal.models.loaders.safetensors import resolve_model_path

    path = resolve_model_path(model, revision, download_dir)
    config = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in served:
        raise ValueError(
            f"model={model!r}: {kind} model_type {config.get('model_type')!r} is not "
            f"supported; vllm-metal serves {served}"
        )
    return path, config
