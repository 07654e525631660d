"""What each backend serves: `SUPPORTED[backend][kind]` is the set of features it serves with a
model of that kind (`kinds.py` x `features.py`). A kind missing from a backend is not served
there at all; a feature missing from a kind's set is refused with that kind.

`refuse_unsupported` runs while vLLM builds its config, before any model is loaded, and raises for
the first missing cell, its message built from both axes: the kind, the feature, the setting that
asked for it and what to change. Serving a feature on a backend is one name in its set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.config.errors import MetalConfigError
from vllm_metal.config.features import BY_NAME as FEATURES_BY_NAME
from vllm_metal.config.features import FEATURES
from vllm_metal.config.kinds import BY_NAME as KINDS_BY_NAME
from vllm_metal.config.kinds import kind_of, model_label, model_type

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# What the MLX runner serves with any model it loads: checkpoint formats and sleep mode.
_MLX_ANY = frozenset({"mlx_quantized", "gguf", "sleep_mode", "data_parallel"})
_MLX_DECODER = _MLX_ANY | {"lora", "speculative_decoding", "kv_offload", "fp8_kv_cache"}
# TurboQuant pages (`kv.turboquant`) on plain attention decoders, in one process.
_MLX_TURBOQUANT = frozenset({"turboquant_kv_cache"})
# What a pipeline stage serves beside its layers (`pipeline_refusal`); the rest is refused there.
PIPELINE_FEATURES = frozenset({"pipeline_parallel"})

SUPPORTED: dict[str, dict[str, frozenset[str]]] = {
    "mlx": {
        # Pipeline stages: the families of `models.families.PIPELINE_STAGE_TYPES`.
        "text": _MLX_DECODER | _MLX_TURBOQUANT | {"pipeline_parallel"},
        "moe": _MLX_DECODER | _MLX_TURBOQUANT | {"pipeline_parallel"},
        "pooling": _MLX_ANY | {"pooling"},
        # Quantized pages under the decoder beside its towers (the towers keep none); TurboQuant
        # where images are attended causally (`config.startup` refuses prefix-LM models).
        "vision_language": _MLX_ANY | {"fp8_kv_cache", "turboquant_kv_cache"},
        "speech_to_text": _MLX_ANY,
        # Qwen3-ASR: float safetensors checkpoints only (the tower loads from them).
        "audio_language": frozenset(),
        "latent_attention": _MLX_ANY | {"speculative_decoding"},
        # Their attention layers' pages quantized, the state pages in the model's dtypes.
        "state_hybrid": _MLX_ANY | {"speculative_decoding", "fp8_kv_cache", "turboquant_kv_cache"},
        # Quantized attention pages beside the float state pages, under the towers.
        "vision_state_hybrid": _MLX_ANY | {"fp8_kv_cache", "turboquant_kv_cache"},
        "short_conv_hybrid": _MLX_ANY | {"fp8_kv_cache", "turboquant_kv_cache"},
        "latent_state_hybrid": _MLX_ANY,
    },
    # vLLM's own dense text decoders on torch (`backends/torch/`), and LFM2's short-convolution
    # layers (`backends/torch/short_conv.py`).
    "mps": {
        "text": frozenset(),
        "short_conv_hybrid": frozenset(),
    },
}

# Backend name -> the `--speculative-config` methods it runs, and the kinds that run fewer.
SPECULATIVE_METHODS: dict[str, tuple[str, ...]] = {
    # mtp: where the family has a drafter built (`_refuse_missing_mtp_head`); eagle3: a head
    # vLLM 0.32 defines beside a Llama / Qwen3 target; dflash: its Qwen3 block-drafting head
    # over the same targets (`_refuse_unfit_aux_head`).
    "mlx": ("ngram", "draft_model", "mtp", "eagle3", "dflash"),
    "mps": (),
}
# Methods vLLM 0.32 defines that are not built here: what is missing.
SPECULATIVE_NOT_BUILT: dict[str, str] = {
    "dspark": "the DSpark block drafter (vLLM's Qwen3DSparkForCausalLM, Gemma4DSparkForCausalLM "
    "and DeepSeek-V4's: parallel block drafting with a Markov head and adaptive verification) is "
    "not built",
    "eagle": "EAGLE-1 heads (vLLM's EagleLlamaForCausalLM, fed the target's last hidden state) "
    "are not built",
}
SPECULATIVE_METHODS_OF_KIND: dict[str, tuple[str, ...]] = {
    # Verification through state layers is tested with n-gram drafts and the target's own MTP
    # head (a draft model beside a hybrid target is not).
    "state_hybrid": ("ngram", "mtp"),
    # MLA models verify through their latent cache with their own MTP layers' drafts.
    "latent_attention": ("mtp",),
}


def refusal(config: VllmConfig, backend: str) -> str | None:
    """The message of the first cell `config` asks for that `backend` does not serve, or None."""
    kind = kind_of(config)
    prefix = f"vllm-metal ({backend} backend) does not serve"
    served = SUPPORTED.get(backend, {}).get(kind.name)
    if served is None:
        model = model_label(config)
        if kind.setting:
            model = f"{kind.setting} with {model}"
        return f"{prefix} {kind.words()}: {model}; {kind.words(kind.advice)}"
    for feature in FEATURES:
        if feature.name in served:
            continue
        setting = feature.requested(config)
        if setting:
            return (
                f"{prefix} {feature.what} with {kind.words()}: {setting} with "
                f"{model_label(config)}; {feature.advice}"
            )
    return None


def refuse_unsupported(config: VllmConfig, backend: str) -> None:
    """Raise MetalConfigError for the first cell `config` asks for that `backend` lacks."""
    message = refusal(config, backend) or pipeline_refusal(config, backend)
    if message is not None:
        raise MetalConfigError(message)
    if config.speculative_config is not None:
        _refuse_unsupported_speculation(config, backend)


def pipeline_refusal(config: VllmConfig, backend: str) -> str | None:
    """Under pipeline parallelism: the message for a model whose decoder a stage cannot split,
    or for the first other feature a stage does not serve; None where it is served."""
    from vllm_metal.models.families import PIPELINE_STAGE_TYPES

    pipeline = FEATURES_BY_NAME["pipeline_parallel"]
    setting = pipeline.requested(config)
    if setting is None:
        return None
    prefix = f"vllm-metal ({backend} backend) does not serve pipeline parallelism"
    served_type = model_type(config)
    if served_type not in PIPELINE_STAGE_TYPES:
        return (
            f"{prefix} with model_type {served_type!r}: {setting} with {model_label(config)}; "
            f"a stage runs a slice of the decoder layers of {', '.join(PIPELINE_STAGE_TYPES)}; "
            f"{pipeline.advice}"
        )
    for feature in FEATURES:
        requested = None if feature.name in PIPELINE_FEATURES else feature.requested(config)
        if requested:
            return (
                f"{prefix} with {feature.what}: {setting} with {requested}; {feature.advice}, "
                f"or {pipeline.advice}"
            )
    return None


def _refuse_unsupported_speculation(config: VllmConfig, backend: str) -> None:
    spec = config.speculative_config
    kind = kind_of(config)
    methods = SPECULATIVE_METHODS.get(backend, ())
    methods = SPECULATIVE_METHODS_OF_KIND.get(kind.name, methods)
    prefix = f"vllm-metal ({backend} backend): --speculative-config"
    if spec.method not in methods:
        missing = SPECULATIVE_NOT_BUILT.get(spec.method)
        raise MetalConfigError(
            f"{prefix} method={spec.method!r} is not supported with {kind.words()}"
            + ("" if missing is None else f": {missing}")
            + "; use method "
            + " or ".join(repr(m) for m in methods)
        )
    if spec.method == "mtp":
        fallback = "use method 'ngram'" if "ngram" in methods else "serve it without drafts"
        _refuse_missing_mtp_head(config, prefix, fallback)
    if spec.method in ("eagle3", "dflash"):
        _refuse_unfit_aux_head(config, prefix)
    for name, value, wanted in (
        ("draft_sample_method", spec.draft_sample_method, "greedy"),
        ("rejection_sample_method", spec.rejection_sample_method, "standard"),
        # vLLM turns it on for a DFlash head, which drafts a whole block at once.
        ("parallel_drafting", spec.parallel_drafting, spec.method == "dflash"),
    ):
        if value != wanted:
            raise MetalConfigError(
                f"{prefix} {name}={value!r} is not supported; use {wanted!r} (the default)"
            )


def _refuse_unfit_aux_head(config: VllmConfig, prefix: str) -> None:
    """methods 'eagle3' and 'dflash' draft with a head of vLLM's architectures for them
    (`families.eagle3`, `families.dflash`) over a target whose aux hidden states the runner keeps;
    the head's attention layers share the target's KV-cache group, so their K/V heads and head
    size must be the target's (the weights are checked when it loads)."""
    from vllm_metal.models.families import dflash, eagle3

    spec = config.speculative_config
    draft = spec.draft_model_config
    target = config.model_config
    family = eagle3 if spec.method == "eagle3" else dflash
    problem = family.missing(
        draft.architectures[0], draft.hf_config.to_dict(), target.hf_text_config.to_dict()
    )
    if problem is None and (
        draft.get_num_kv_heads(spec.draft_parallel_config),
        draft.get_head_size(),
    ) != (target.get_num_kv_heads(config.parallel_config), target.get_head_size()):
        problem = "its K/V heads or head size differ from the target's"
    if problem is not None:
        raise MetalConfigError(
            f"{prefix} method={spec.method!r} with {model_label(config)} and "
            f"model={spec.model!r}: {problem}; use method 'ngram' or 'draft_model'"
        )


def _refuse_missing_mtp_head(config: VllmConfig, prefix: str, fallback: str) -> None:
    """method 'mtp' drafts with a model's multi-token-prediction drafter: the target's own head
    (Qwen3.5, DeepSeek-V3, GLM-4.7-Flash, Nemotron-H) or an assistant checkpoint named by the
    speculative config's `model` (Gemma 4). The target's family must have one built here, the
    draft vLLM read must be that drafter, and the two configs must fit together (the weights are
    checked when they load). `fallback`: what to do instead, for the kind's other methods."""
    from vllm_metal.models.families import mtp_drafter_module, mtp_model_types, mtp_module

    spec = config.speculative_config
    text_type = model_type(config, text=True)
    module = mtp_module(text_type)
    draft = spec.draft_model_config.hf_config
    draft_type = getattr(draft, "model_type", None)
    if module is not None and draft_type in module.DRAFT_MODEL_TYPES:
        problem = module.missing(config.model_config.hf_text_config.to_dict(), draft.to_dict())
        if problem is None:
            return
        raise MetalConfigError(
            f"{prefix} method='mtp' with {model_label(config)} and model={spec.model!r}: "
            f"{problem}; {fallback}"
        )
    other = mtp_drafter_module(draft_type)
    if other is not None and other is not module:  # another family's drafter
        targets = ", ".join(other.MODEL_TYPES)
        raise MetalConfigError(
            f"{prefix} method='mtp': model={spec.model!r} is an MTP drafter ({draft_type}) for "
            f"{targets} targets, not for {model_label(config)}; {fallback}"
        )
    if module is None:
        raise MetalConfigError(
            f"{prefix} method='mtp' drafts with a model's own multi-token-prediction head or "
            f"its MTP assistant, built for {', '.join(sorted(mtp_model_types()))}, not for "
            f"{model_label(config)}; {fallback}"
        )
    raise MetalConfigError(
        f"{prefix} method='mtp' with {model_label(config)}: model={spec.model!r} "
        f"({draft_type}) is not its MTP drafter; "
        + (
            "name its own checkpoint (or leave model unset)"
            if module.HEAD_IN_TARGET
            else "set model to its MTP assistant's checkpoint"
        )
    )


def check_table() -> list[str]:
    """What is wrong with the table itself: names that are no kind or feature."""
    problems = []
    for backend, kinds in SUPPORTED.items():
        for kind, features in kinds.items():
            if kind not in KINDS_BY_NAME:
                problems.append(f"SUPPORTED[{backend!r}]: {kind!r} is no model kind")
            problems += [
                f"SUPPORTED[{backend!r}][{kind!r}]: {f!r} is no feature"
                for f in sorted(features - set(FEATURES_BY_NAME))
            ]
    return problems
