"""What each backend can serve, as one table: a row per capability vLLM can be asked for.

`MetalPlatform.check_and_update_config` calls `refuse_unsupported` while vLLM builds its config,
before any model is loaded, so a request for something a backend lacks fails at startup with the
setting to change. Enabling a capability on a backend is adding its key to `SUPPORTED`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_metal.kv.offload import CONNECTOR
from vllm_metal.quantization import CHECKPOINT_QUANTIZATIONS

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class MetalConfigError(ValueError):
    """A setting this platform cannot serve; raised at startup with what to change."""


@dataclass(frozen=True)
class Capability:
    key: str
    what: str  # what the user asked for, in words
    advice: str  # the setting to change
    # The requested setting as "name=value" when the config asks for the capability, else None.
    requested: Callable[[VllmConfig], str | None]


def _model_attr(config: VllmConfig, name: str, default: object = None) -> object:
    model = config.model_config
    return default if model is None else getattr(model, name, default)


# model_type of the encoder-decoder checkpoints the speech runner serves
# (`backends/mlx/runner/speech/`).
SPEECH_TO_TEXT_MODEL_TYPES = ("whisper",)

# model_type of the vision-language checkpoints whose towers the MLX runner runs
# (`models/multimodal.py`, `backends/mlx/runner/mm/`) -> the modalities they encode; vLLM's front
# end is told to refuse the others (`mm_frontend`).
VISION_LANGUAGE_MODALITIES: dict[str, tuple[str, ...]] = {
    "gemma3": ("image",),
    "idefics3": ("image",),
    "qwen2_5_vl": ("image", "video"),
    "qwen3_vl": ("image", "video"),
}
VISION_LANGUAGE_MODEL_TYPES = tuple(VISION_LANGUAGE_MODALITIES)


def speech_model(config: VllmConfig) -> str | None:
    """ "model=... (whisper)" when the config serves a speech-to-text model, else None."""
    hf_config = _model_attr(config, "hf_config")
    model_type = getattr(hf_config, "model_type", None)
    if (
        _model_attr(config, "is_encoder_decoder", False)
        and model_type in SPEECH_TO_TEXT_MODEL_TYPES
    ):
        return f"model={_model_attr(config, 'model')!r} ({model_type})"
    return None


def vision_language_model(config: VllmConfig) -> str | None:
    """ "model=... (idefics3)" when the config serves a vision-language model whose towers the
    MLX runner runs, else None."""
    model_type = getattr(_model_attr(config, "hf_config"), "model_type", None)
    if _model_attr(config, "is_multimodal_model", False) and (
        model_type in VISION_LANGUAGE_MODEL_TYPES
    ):
        return f"model={_model_attr(config, 'model')!r} ({model_type})"
    return None


def hybrid_model(config: VllmConfig) -> str | None:
    """ "model=... (qwen3_next)" when the config serves a hybrid model whose state layers the MLX
    runner runs (`models.layers.STATE_SHAPES`), else None."""
    from vllm_metal.models.layers import STATE_SHAPES

    model_type = getattr(_model_attr(config, "hf_text_config"), "model_type", None)
    if _model_attr(config, "is_hybrid", False) and model_type in STATE_SHAPES:
        return f"model={_model_attr(config, 'model')!r} ({model_type})"
    return None


# model_type of the short-convolution hybrids (gated short convolutions between attention layers)
# the torch backend serves through vLLM's own model class (`backends/torch/short_conv.py`).
SHORT_CONV_MODEL_TYPES = ("lfm2",)


def short_conv_model(config: VllmConfig) -> str | None:
    """ "model=... (lfm2)" when the config serves a short-convolution hybrid (LFM2), else None."""
    model_type = getattr(_model_attr(config, "hf_text_config"), "model_type", None)
    if (
        _model_attr(config, "is_hybrid", False)
        and not _model_attr(config, "is_multimodal_model", False)
        and model_type in SHORT_CONV_MODEL_TYPES
    ):
        return f"model={_model_attr(config, 'model')!r} ({model_type})"
    return None


def _any_hybrid(config: VllmConfig) -> str | None:
    return hybrid_model(config) or short_conv_model(config)


def latent_attention_model(config: VllmConfig) -> str | None:
    """ "model=... (deepseek_v3)" when the config serves a multi-head latent attention (MLA) model
    the MLX runner runs (`models.layers.LATENT_ATTENTION_MODEL_TYPES`), else None."""
    from vllm_metal.models.layers import LATENT_ATTENTION_MODEL_TYPES

    model_type = getattr(_model_attr(config, "hf_text_config"), "model_type", None)
    if _model_attr(config, "use_mla", False) and model_type in LATENT_ATTENTION_MODEL_TYPES:
        return f"model={_model_attr(config, 'model')!r} ({model_type})"
    return None


def _other_latent_attention(config: VllmConfig) -> str | None:
    if _model_attr(config, "use_mla", False) and not latent_attention_model(config):
        return f"model={_model_attr(config, 'model')!r} ({_architecture(config)}, MLA)"
    return None


def _other_hybrid(config: VllmConfig) -> str | None:
    if _model_attr(config, "is_hybrid", False) and not _any_hybrid(config):
        return f"model={_model_attr(config, 'model')!r} ({_architecture(config)}, hybrid)"
    return None


def _language_model_only(config: VllmConfig) -> bool:
    """Whether vLLM takes no media items for this model (`--language-model-only`, or set by
    `mm_frontend` for checkpoints whose language model mlx-lm loads)."""
    mm = _model_attr(config, "multimodal_config")
    return bool(getattr(mm, "language_model_only", False))


def _architecture(config: VllmConfig) -> str:
    architectures = getattr(_model_attr(config, "hf_config"), "architectures", None) or ["?"]
    return architectures[0]


def _extras_with(model_of: Callable[[VllmConfig], str | None]):
    """The setting asked for beside the model `model_of` names that its runner does not run."""
    return lambda config: (model := model_of(config)) and _extra_setting(config, model)


def _pooling_with(model_of: Callable[[VllmConfig], str | None]):
    """The pooling runner asked for with the model `model_of` names."""
    return lambda config: (
        _model_attr(config, "runner_type") == "pooling"
        and (model := model_of(config))
        and f"runner='pooling' with {model}"
    )


def _extra_setting(config: VllmConfig, model: str) -> str | None:
    if getattr(_model_attr(config, "multimodal_config"), "enable_mm_embeds", False):
        return f"--enable-mm-embeds with {model}"
    if config.lora_config is not None:
        return f"--enable-lora with {model}"
    if config.speculative_config is not None:
        return f"--speculative-config with {model}"
    if setting := offload_setting(config):
        return f"{setting} with {model}"
    return None


def offload_setting(config: VllmConfig) -> str | None:
    """The setting that turns KV offloading on (`vllm_metal.kv.offload.config`), if any."""
    from vllm_metal import envs

    transfer = config.kv_transfer_config
    if config.cache_config.kv_offloading_size is not None:
        return f"kv_offloading_size={config.cache_config.kv_offloading_size}"
    if transfer is not None and transfer.kv_connector == CONNECTOR:
        return f"--kv-transfer-config kv_connector={CONNECTOR!r}"
    if envs.VLLM_METAL_SSD_CACHE_DIR is not None:
        return f"VLLM_METAL_SSD_CACHE_DIR={envs.VLLM_METAL_SSD_CACHE_DIR!r}"
    return None


def _mlx_quantized(config: VllmConfig) -> str | None:
    """The quantization of an MLX-quantized checkpoint (mlx_lm.convert -q), if it is one."""
    quant = getattr(_model_attr(config, "hf_config"), "quantization", None)
    if isinstance(quant, dict) and "bits" in quant:
        return f"model={_model_attr(config, 'model')!r} (MLX-quantized, {quant['bits']} bits)"
    return None


def _gguf_file(config: VllmConfig) -> str | None:
    from vllm_metal.models.loaders import is_gguf

    model = _model_attr(config, "model")
    return f"model={model!r} (GGUF)" if is_gguf(model) else None


CAPABILITIES: tuple[Capability, ...] = (
    Capability(
        "tensor_parallel",
        "tensor parallelism (vllm-metal serves on one device)",
        "use --tensor-parallel-size 1",
        lambda c: (n := c.parallel_config.tensor_parallel_size) > 1 and f"tensor_parallel_size={n}",
    ),
    Capability(
        "pipeline_parallel",
        "pipeline parallelism (vllm-metal serves on one device)",
        "use --pipeline-parallel-size 1",
        lambda c: (
            (n := c.parallel_config.pipeline_parallel_size) > 1 and f"pipeline_parallel_size={n}"
        ),
    ),
    Capability(
        "data_parallel",
        "data parallelism",
        "use --data-parallel-size 1",
        lambda c: (n := c.parallel_config.data_parallel_size) > 1 and f"data_parallel_size={n}",
    ),
    Capability(
        "lora",
        "LoRA adapters",
        "remove --enable-lora",
        lambda c: c.lora_config is not None and "--enable-lora",
    ),
    Capability(
        "speculative_decoding",
        "speculative decoding",
        "remove --speculative-config",
        lambda c: (
            c.speculative_config is not None
            and f"--speculative-config method={c.speculative_config.method!r}"
        ),
    ),
    Capability(
        "pooling",
        "pooling models (embeddings, classification, scoring)",
        "serve a generative model (--runner generate)",
        lambda c: _model_attr(c, "runner_type") == "pooling" and "runner='pooling'",
    ),
    Capability(
        "pooling_lora",
        "LoRA adapters on pooling models",
        "remove --enable-lora",
        lambda c: (
            c.lora_config is not None
            and _model_attr(c, "runner_type") == "pooling"
            and "--enable-lora with runner='pooling'"
        ),
    ),
    Capability(
        "multimodal",
        "multimodal (image, video, audio) inputs beyond the vision-language families "
        f"{', '.join(VISION_LANGUAGE_MODEL_TYPES)}",
        "serve a text-only model or one of those families (a checkpoint whose language model "
        "mlx-lm loads is served text-only)",
        lambda c: (
            bool(_model_attr(c, "is_multimodal_model", False))
            and not speech_model(c)
            and not vision_language_model(c)
            and not _language_model_only(c)
            and f"model={_model_attr(c, 'model')!r} ({_architecture(c)}, multimodal)"
        ),
    ),
    Capability(
        "vision_language",
        f"vision-language models ({', '.join(VISION_LANGUAGE_MODEL_TYPES)})",
        "serve a text model",
        vision_language_model,
    ),
    Capability(
        "vision_language_extras",
        "LoRA adapters, speculative decoding, KV offloading and embedding inputs "
        "(--enable-mm-embeds) on vision-language models",
        "remove that setting",
        _extras_with(vision_language_model),
    ),
    Capability(
        "encoder_decoder",
        "encoder-decoder models other than speech-to-text (Whisper)",
        "serve a decoder-only model or a Whisper checkpoint",
        lambda c: (
            bool(_model_attr(c, "is_encoder_decoder", False))
            and not speech_model(c)
            and f"model={_model_attr(c, 'model')!r} ({_architecture(c)}, encoder-decoder)"
        ),
    ),
    Capability(
        "speech_to_text",
        "speech-to-text models (Whisper)",
        "serve a text model",
        speech_model,
    ),
    Capability(
        "speech_to_text_extras",
        "LoRA adapters, speculative decoding and KV offloading on speech-to-text models",
        "remove that setting",
        _extras_with(speech_model),
    ),
    Capability(
        "hybrid",
        "hybrid models with Gated DeltaNet or Mamba-2 state layers (Qwen3-Next, Granite 4.0-H)",
        "serve a model with attention layers only",
        hybrid_model,
    ),
    Capability(
        "short_conv_hybrid",
        "short-convolution hybrid models (LFM2)",
        "use the torch backend (VLLM_METAL_BACKEND=mps), or serve a model with attention layers "
        "only",
        short_conv_model,
    ),
    Capability(
        "hybrid_other",
        "hybrid models other than Qwen3-Next, Granite 4.0-H and LFM2 (other Mamba layouts, "
        "other short convolutions, linear attention of other kinds)",
        "serve one of those hybrids or a model with attention layers only",
        _other_hybrid,
    ),
    Capability(
        "hybrid_extras",
        "LoRA adapters, speculative decoding and KV offloading on hybrid models",
        "remove that setting",
        _extras_with(_any_hybrid),
    ),
    Capability(
        "hybrid_pooling",
        "pooling (embeddings, classification, scoring) with hybrid models",
        "serve it with --runner generate",
        _pooling_with(_any_hybrid),
    ),
    Capability(
        "mla",
        "multi-head latent attention (MLA) models (DeepSeek-V3)",
        "serve a model with standard attention",
        latent_attention_model,
    ),
    Capability(
        "mla_other",
        "multi-head latent attention (MLA) models other than DeepSeek-V3 (DeepSeek-V2, "
        "DeepSeek-V3.2's sparse attention, Kimi, GLM-4.7-Flash, MiniCPM3, ...)",
        "serve a DeepSeek-V3-architecture model or one with standard attention",
        _other_latent_attention,
    ),
    Capability(
        "mla_extras",
        "LoRA adapters, speculative decoding and KV offloading on MLA models",
        "remove that setting",
        _extras_with(latent_attention_model),
    ),
    Capability(
        "mla_pooling",
        "pooling (embeddings, classification, scoring) with MLA models",
        "serve it with --runner generate",
        _pooling_with(latent_attention_model),
    ),
    Capability(
        "mixture_of_experts",
        "mixture-of-experts models",
        "serve a dense model, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        lambda c: (
            bool(_model_attr(c, "is_moe", False))
            and f"model={_model_attr(c, 'model')!r} ({_architecture(c)}, MoE)"
        ),
    ),
    Capability(
        "mlx_quantized",
        "MLX-quantized checkpoints",
        "serve the unquantized checkpoint, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        _mlx_quantized,
    ),
    Capability(
        "gguf",
        "GGUF checkpoints",
        "serve a safetensors checkpoint, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        _gguf_file,
    ),
    Capability(
        "sleep_mode",
        "sleep mode",
        "remove --enable-sleep-mode",
        lambda c: bool(_model_attr(c, "enable_sleep_mode", False)) and "--enable-sleep-mode",
    ),
    Capability(
        "vllm_quantization",
        "vLLM quantization methods",
        "serve an MLX-quantized checkpoint (mlx_lm.convert -q) instead of --quantization",
        lambda c: (
            (q := _model_attr(c, "quantization")) is not None
            and q not in CHECKPOINT_QUANTIZATIONS
            and f"quantization={q!r}"
        ),
    ),
    Capability(
        "kv_connector",
        "KV connectors other than vLLM's offloading connector",
        "use --kv-offloading-size (the native OffloadingConnector)",
        lambda c: (
            c.kv_transfer_config is not None
            and c.kv_transfer_config.kv_connector not in (None, CONNECTOR)
            and f"--kv-transfer-config kv_connector={c.kv_transfer_config.kv_connector!r}"
        ),
    ),
    Capability(
        "kv_offload",
        "KV offloading",
        "remove --kv-offloading-size / VLLM_METAL_SSD_CACHE_DIR",
        lambda c: offload_setting(c),
    ),
    Capability(
        "kv_offload_pooling",
        "KV offloading for pooling models",
        "remove --kv-offloading-size / VLLM_METAL_SSD_CACHE_DIR",
        lambda c: (
            _model_attr(c, "runner_type") == "pooling"
            and (s := offload_setting(c))
            and f"{s} with runner='pooling'"
        ),
    ),
    Capability(
        "kv_offload_draft_model",
        "KV offloading with a draft model (its KV cache is not offloaded)",
        "remove --kv-offloading-size / VLLM_METAL_SSD_CACHE_DIR, or draft with method 'ngram'",
        lambda c: (
            c.speculative_config is not None
            and c.speculative_config.uses_draft_model()
            and (s := offload_setting(c))
            and f"{s} with --speculative-config method={c.speculative_config.method!r}"
        ),
    ),
)

# Backend name -> keys of CAPABILITIES it serves.
SUPPORTED: dict[str, frozenset[str]] = {
    "mlx": frozenset(
        {
            "speculative_decoding",
            "lora",
            "pooling",
            "kv_offload",
            "speech_to_text",
            "vision_language",
            "hybrid",
            "mla",
            "mixture_of_experts",
            "mlx_quantized",
            "gguf",
            "sleep_mode",
        }
    ),
    # vLLM's own dense text decoders on torch (`backends/torch/`), and LFM2's short-convolution
    # layers (`backends/torch/short_conv.py`).
    "mps": frozenset({"short_conv_hybrid"}),
}

# Backend name -> the `--speculative-config` methods it runs.
SPECULATIVE_METHODS: dict[str, tuple[str, ...]] = {
    "mlx": ("ngram", "draft_model"),
    "mps": (),
}


def refuse_unsupported(config: VllmConfig, backend: str) -> None:
    """Raise MetalConfigError for the first capability asked for that `backend` lacks."""
    supported = SUPPORTED.get(backend, frozenset())
    for cap in CAPABILITIES:
        if cap.key in supported:
            continue
        setting = cap.requested(config)
        if setting:
            raise MetalConfigError(
                f"vllm-metal ({backend} backend): {cap.what} is not supported: {setting}; "
                f"{cap.advice}"
            )
    if config.speculative_config is not None:
        _refuse_unsupported_speculation(config, backend)


def _refuse_unsupported_speculation(config: VllmConfig, backend: str) -> None:
    spec = config.speculative_config
    methods = SPECULATIVE_METHODS.get(backend, ())
    prefix = f"vllm-metal ({backend} backend): --speculative-config"
    if spec.method not in methods:
        raise MetalConfigError(
            f"{prefix} method={spec.method!r} is not supported; use method "
            + " or ".join(repr(m) for m in methods)
        )
    if spec.draft_sample_method != "greedy":
        raise MetalConfigError(
            f"{prefix} draft_sample_method={spec.draft_sample_method!r} is not supported; "
            "use 'greedy' (the default)"
        )
    if spec.parallel_drafting:
        raise MetalConfigError(f"{prefix} parallel_drafting=True is not supported; remove it")
    if spec.rejection_sample_method != "standard":
        raise MetalConfigError(
            f"{prefix} rejection_sample_method={spec.rejection_sample_method!r} is not "
            "supported; use 'standard' (the default)"
        )
