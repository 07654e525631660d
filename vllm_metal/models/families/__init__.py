"""Adapters for the families whose mlx-lm class needs more than the generic adapter, keyed by
`model_type` (one small module each). Each family module declares what it is to the capability
table: its `MODEL_TYPES`, its `KIND` and the `MODALITIES` its towers encode (`declarations`),
and where those towers run only on some hosts, a `towers_run()` that says whether here
(`runs_towers`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

from vllm_metal.models.adapter import ModelAdapter

# The modules of this package, one per family; each lists the `MODEL_TYPES` it serves. Those that
# define `Adapter` give the decoder adapter of their model types; the others (encoder-only models,
# `models/encoder.py`; speech-to-text, `WhisperAdapter`) are served by their own loaders.
MODULES = (
    "bert",
    "deepseek_v2",
    "deepseek_v3",
    "falcon_h1",
    "glm4_moe_lite",
    "gemma2",
    "gemma3",
    "gemma4",
    "gemma4_vl",
    "gpt_oss",
    "granitemoehybrid",
    "idefics3",
    "kimi_linear",
    "layer_stack",
    "lfm2",
    "minicpm3",
    "ministral3",
    "mistral",
    "nemotron_h",
    "qwen2_5_vl",
    "qwen2_moe",
    "qwen3_5",
    "qwen3_5_vl",
    "qwen3_asr",
    "qwen3_next",
    "qwen3_vl",
    "whisper",
    "xlm_roberta",
)


@dataclass(frozen=True)
class Declaration:
    """What a `model_type` is to the capability table (`vllm_metal.config.kinds`)."""

    model_type: str
    kind: str
    modalities: tuple[str, ...] = ()


# The architectures served without a module here that the capability table must still tell
# apart (none today); any other mlx-lm architecture is a plain text decoder.
WITHOUT_ADAPTER: tuple[Declaration, ...] = ()


# mlx-lm architectures the generic adapter serves as they are (no module here) that the tests
# check against transformers.
GENERIC_VERIFIED = ("llama", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
# Generic-adapter families whose mlx-lm decoder is embeddings -> layers -> final norm and nothing
# else (no embedding scale, no per-layer inputs), so a pipeline stage runs a slice of its layers
# (`ModelAdapter.forward_stage`).
PIPELINE_STAGE_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def verified(model_type: str | None) -> bool:
    """Whether this project checks `model_type` against transformers: a family module declares it
    or the generic adapter serves it (`GENERIC_VERIFIED`)."""
    return model_type in GENERIC_VERIFIED or model_type in declarations()


@cache
def declarations() -> dict[str, Declaration]:
    """model_type -> its declaration, from every family module and `WITHOUT_ADAPTER`."""
    found = {d.model_type: d for d in WITHOUT_ADAPTER}
    for module in map(_module, MODULES):
        for model_type in module.MODEL_TYPES:
            found[model_type] = Declaration(model_type, module.KIND, module.MODALITIES)
    return found


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


@cache
def _adapter_modules() -> dict[str, str]:
    """model_type -> the module whose `Adapter` serves it."""
    return {
        model_type: name
        for name in MODULES
        if hasattr(module := _module(name), "Adapter")
        for model_type in module.MODEL_TYPES
    }


def model_types(kind: str) -> tuple[str, ...]:
    """The model types declared as `kind`, sorted."""
    return tuple(sorted(t for t, d in declarations().items() if d.kind == kind))


def runs_towers(model_type: str | None) -> bool:
    """Whether the towers of `model_type` run on this host: a family that declares modalities
    runs them unless its module's `towers_run()` says the media cannot be prepared here."""
    declared = declarations().get(model_type or "")
    if declared is None or not declared.modalities:
        return False
    name = _adapter_modules().get(declared.model_type)
    return name is None or getattr(_module(name), "towers_run", lambda: True)()


def towers_beside_language_model(model_type: str | None) -> bool:
    """Whether the family of `model_type` attaches its towers to mlx-lm's language model
    (its adapter's `load_towers`) instead of loading the whole model through mlx-vlm: its
    language model is then served alone where the towers do not run."""
    return model_type in _adapter_modules() and hasattr(adapter_class(model_type), "load_towers")


def adapter_class(model_type: str | None) -> type[ModelAdapter]:
    name = _adapter_modules().get(model_type or "")
    return ModelAdapter if name is None else _module(name).Adapter


# The modules of this package that build a model's multi-token-prediction drafter
# (`--speculative-config method=mtp`); each lists the target model types it serves in its
# `MODEL_TYPES`, the drafter's model type as vLLM names it in `DRAFT_MODEL_TYPES`, whether the
# drafter is tensors of the target's checkpoint (`HEAD_IN_TARGET`: `load_head`) or a checkpoint of
# its own that the speculative config's `model` names (`load_assistant`), and in `missing(target,
# draft)` what keeps the two configs from drafting together.
MTP_MODULES = ("deepseek_mtp", "gemma4_mtp", "nemotron_h_mtp", "qwen3_5_mtp")


@cache
def mtp_model_types() -> dict[str, str]:
    """model_type -> the module of `MTP_MODULES` that builds its head."""
    return {t: name for name in MTP_MODULES for t in _module(name).MODEL_TYPES}


def mtp_module(model_type: str | None):
    """The MTP drafter module of the target `model_type`, or None where this project builds
    none."""
    name = mtp_model_types().get(model_type or "")
    return None if name is None else _module(name)


def mtp_drafter_module(draft_type: str | None):
    """The MTP module that builds the drafter vLLM names `draft_type`, or None."""
    name = next((m for m in MTP_MODULES if draft_type in _module(m).DRAFT_MODEL_TYPES), None)
    return None if name is None else _module(name)


# model_type -> module in this package defining `sanitize(weights) -> weights`, run on the
# checkpoint's tensors before mlx-lm's own `sanitize` (layouts mlx-lm does not read).
SANITIZERS = {
    "deepseek_v3": "deepseek_mtp",
    "kimi_k2": "deepseek_mtp",
    "gpt_oss": "gpt_oss",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_asr": "qwen3_asr",
}


@cache
def _mlx_lm_modules() -> dict[str, str]:
    """model_type -> the mlx-lm module that reads it, where mlx-lm's lookup does not know the
    model_type (a family's `MLX_LM_MODULES`)."""
    found: dict[str, str] = {}
    for module in map(_module, MODULES):
        found |= getattr(module, "MLX_LM_MODULES", {})
    return found


def family_classes(get_classes):
    """mlx-lm's class lookup (`get_model_classes` of `load_model`, or `mlx_lm.utils._get_classes`)
    as the families extend it: model types mlx-lm reads under another module's name
    (`MLX_LM_MODULES`), and for the families of `SANITIZERS` a subclass whose `sanitize` runs the
    family's before mlx-lm's."""

    def get(config: dict) -> tuple[type, type]:
        model_type = config.get("model_type") or ""
        module = _mlx_lm_modules().get(model_type)
        lookup = config if module is None else {**config, "model_type": module}
        model_class, args_class = get_classes(lookup)
        name = SANITIZERS.get(model_type)
        if name is None:
            return model_class, args_class
        family_sanitize = importlib.import_module(f"{__name__}.{name}").sanitize

        class Sanitized(model_class):
            def sanitize(self, weights):
                weights = family_sanitize(weights)
                return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

        # The module stays mlx-lm's: attention routing patches the module that defines the class.
        Sanitized.__name__ = Sanitized.__qualname__ = model_class.__name__
        Sanitized.__module__ = model_class.__module__
        return Sanitized, args_class

    return get
