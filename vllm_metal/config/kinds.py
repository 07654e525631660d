"""The first axis of the capability table: what kind of model a config serves.

`KINDS` is tried in order and the first kind whose `detect` holds is the model's: the served
kinds by the `model_type` their family declares (`vllm_metal.models.families`), then the
unserved shapes of the same kind ("other MLA models"), then pooling, mixture-of-experts and plain
text decoders. A kind's words may name the model types of a kind as `{kind_name}`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class ModelKind:
    name: str
    what: str  # the kind, in words (plural)
    advice: str  # what to do where a backend does not serve the kind at all
    detect: Callable[[VllmConfig], bool]
    # The setting that makes a model this kind, where one does (not the checkpoint alone).
    setting: str | None = None

    def words(self, text: str | None = None) -> str:
        return (self.what if text is None else text).format_map(_DeclaredTypes())


class _DeclaredTypes(dict):
    def __missing__(self, kind: str) -> str:
        from vllm_metal.models.families import model_types

        return ", ".join(model_types(kind))


def model_attr(config: VllmConfig, name: str, default: Any = None) -> Any:
    model = getattr(config, "model_config", None)
    return default if model is None else getattr(model, name, default)


def model_type(config: VllmConfig, text: bool = False) -> str | None:
    """The checkpoint's `model_type` (its text model's with `text`)."""
    hf = model_attr(config, "hf_text_config" if text else "hf_config")
    return getattr(hf, "model_type", None)


def model_label(config: VllmConfig) -> str:
    """ "model='...' (model_type, Architecture)": how a refusal names the model."""
    architectures = getattr(model_attr(config, "hf_config"), "architectures", None) or ["?"]
    kind = model_type(config) or model_type(config, text=True)
    return f"model={model_attr(config, 'model')!r} ({kind}, {architectures[0]})"


def _declared(kind: str, text: bool = False) -> Callable[[VllmConfig], bool]:
    def detect(config: VllmConfig) -> bool:
        from vllm_metal.models.families import model_types

        return model_type(config, text) in model_types(kind)

    return detect


def _flag(name: str) -> Callable[[VllmConfig], bool]:
    return lambda config: bool(model_attr(config, name, False))


def _all(*tests: Callable[[VllmConfig], bool]) -> Callable[[VllmConfig], bool]:
    return lambda config: all(test(config) for test in tests)


def _language_model_only(config: VllmConfig) -> bool:
    """vLLM takes no media items (`--language-model-only`, or set by `config.multimodal` for a
    checkpoint whose language model mlx-lm loads)."""
    return bool(getattr(model_attr(config, "multimodal_config"), "language_model_only", False))


def _towers_beside(config: VllmConfig) -> bool:
    """Whether the family loads its towers beside mlx-lm's language model (which then serves
    alone without them)."""
    from vllm_metal.models.families import towers_beside_language_model

    return towers_beside_language_model(model_type(config))


KINDS: tuple[ModelKind, ...] = (
    ModelKind(
        "speech_to_text",
        "speech-to-text models ({speech_to_text})",
        "serve a text model",
        _all(_flag("is_encoder_decoder"), _declared("speech_to_text")),
    ),
    ModelKind(
        "encoder_decoder",
        "encoder-decoder models other than speech-to-text ({speech_to_text})",
        "serve a decoder-only model or a speech-to-text one ({speech_to_text})",
        _flag("is_encoder_decoder"),
    ),
    ModelKind(
        "vision_state_hybrid",
        "vision-language models with Gated DeltaNet state layers ({vision_state_hybrid})",
        "serve a text model",
        # With `language_model_only` (set where their towers do not run) they are state hybrids.
        _all(
            _flag("is_multimodal_model"),
            _declared("vision_state_hybrid"),
            lambda c: not _language_model_only(c),
        ),
    ),
    ModelKind(
        "vision_language",
        "vision-language models ({vision_language})",
        "serve a text model",
        # A family whose towers sit beside mlx-lm's language model (Gemma 4) is a text decoder
        # with `language_model_only` (set where its towers do not run).
        _all(
            _flag("is_multimodal_model"),
            _declared("vision_language"),
            lambda c: not (_language_model_only(c) and _towers_beside(c)),
        ),
    ),
    ModelKind(
        "audio_language",
        "audio-language models ({audio_language})",
        "serve a text model, or a speech-to-text one",
        _all(_flag("is_multimodal_model"), _declared("audio_language")),
    ),
    ModelKind(
        "multimodal",
        "multimodal models (image, video, audio inputs) other than the vision-language "
        "families ({vision_language})",
        "serve a text-only model or one of those families (a checkpoint whose language model "
        "mlx-lm loads is served text-only)",
        _all(_flag("is_multimodal_model"), lambda c: not _language_model_only(c)),
    ),
    ModelKind(
        "latent_attention",
        "multi-head latent attention (MLA) models ({latent_attention})",
        "serve a model with standard attention",
        # By the family alone: vLLM's config does not call every MLA model one (MiniCPM3).
        _declared("latent_attention", text=True),
    ),
    ModelKind(
        # Kimi-Linear: MLA layers between Kimi Delta Attention layers (a gated delta rule that
        # decays each key channel on its own); their state pages share the latent cache.
        "latent_state_hybrid",
        "hybrid models with multi-head latent attention (MLA) beside Kimi Delta Attention state "
        "layers ({latent_state_hybrid})",
        "serve a model with attention layers only",
        _all(_flag("use_mla"), _flag("is_hybrid"), _declared("latent_state_hybrid", text=True)),
    ),
    ModelKind(
        "latent_attention_other",
        "multi-head latent attention (MLA) models other than {latent_attention} (DeepSeek-V3.2's "
        "sparse attention, ...)",
        "serve one of those models or one with standard attention",
        _flag("use_mla"),
    ),
    ModelKind(
        "state_hybrid",
        "hybrid models with Gated DeltaNet or Mamba-2 state layers ({state_hybrid})",
        "serve a model with attention layers only",
        _all(_flag("is_hybrid"), _declared("state_hybrid", text=True)),
    ),
    ModelKind(
        "short_conv_hybrid",
        "short-convolution hybrid models ({short_conv_hybrid})",
        "use the torch backend (VLLM_METAL_BACKEND=mps), or serve a model with attention layers "
        "only",
        _all(
            _flag("is_hybrid"),
            lambda c: not model_attr(c, "is_multimodal_model", False),
            _declared("short_conv_hybrid", text=True),
        ),
    ),
    ModelKind(
        "hybrid_other",
        "hybrid models other than {state_hybrid}, {short_conv_hybrid} (other Mamba layouts, "
        "other short convolutions, linear attention of other kinds)",
        "serve one of those hybrids or a model with attention layers only",
        _flag("is_hybrid"),
    ),
    ModelKind(
        "pooling",
        "pooling models (embeddings, classification, scoring)",
        "serve a generative model (--runner generate)",
        lambda c: model_attr(c, "runner_type") == "pooling",
        setting="runner='pooling'",
    ),
    ModelKind(
        "moe",
        "mixture-of-experts models",
        "serve a dense model, or use the MLX backend (VLLM_METAL_BACKEND=mlx)",
        _flag("is_moe"),
    ),
    ModelKind("text", "text decoders", "serve another model", lambda c: True),
)

BY_NAME = {kind.name: kind for kind in KINDS}


def kind_of(config: VllmConfig) -> ModelKind:
    """The kind of model `config` serves: the first of `KINDS` that detects it."""
    return next(kind for kind in KINDS if kind.detect(config))
