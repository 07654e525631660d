"""How vLLM's multimodal front end and scheduler are set up for what the MLX runner encodes.

A Mistral 3, Pixtral or Qwen2-VL checkpoint carries a language model that mlx-lm loads by itself
(its `mistral3`, `pixtral`, `qwen2_vl`, ... modules drop the vision weights). Until a family
module runs such a tower (kind `vision_language`, or `vision_state_hybrid` where its
`towers_run()` holds: Qwen3.5 where vLLM's processor imports), the platform serves the language model and
sets vLLM's `language_model_only`: the front end then answers a request that carries an image,
video or audio item with a 400 ("At most 0 image(s) may be provided in one prompt"), before it
reaches the engine. A multimodal checkpoint without such an mlx-lm module is refused at startup
(model kind `multimodal`).

A vision-language family gets a per-prompt limit of 0 for the modalities it does not declare
(`MODALITIES` of its module) unless `--limit-mm-per-prompt` names them: the family declares every
modality vLLM's model of it takes, so a limit for another one is accepted as vLLM accepts it, and
its requests get vLLM's own 400.

In a prefix-LM family (Gemma 3: vLLM's `is_mm_prefix_lm`) the tokens of one image attend to each
other both ways, so every token of an image must be in the step that attends over them: the
scheduler is told not to cut an image across steps (`disable_chunked_mm_input`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from vllm_metal._logging import init_logger
from vllm_metal.config.errors import MetalConfigError
from vllm_metal.models.families import declarations, model_types, runs_towers

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# The media kinds vLLM's processors take.
MODALITIES = ("image", "video", "audio")


def has_mlx_lm_text_model(model_type: str | None) -> bool:
    """Whether mlx-lm has a module for `model_type` (for a multimodal checkpoint: the module that
    loads its language model alone)."""
    if not model_type or not model_type.isidentifier():
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def serve_language_model_only(vllm_config: VllmConfig) -> bool:
    """Set `language_model_only` for a multimodal checkpoint whose language model mlx-lm loads and
    whose towers no family runs; whether it did."""
    model = vllm_config.model_config
    if model is None or not model.is_multimodal_model or model.is_encoder_decoder:
        return False
    mm = model.multimodal_config
    model_type = getattr(model.hf_config, "model_type", None)
    declared = declarations().get(model_type)
    if (
        mm is None
        or mm.language_model_only
        or (declared is not None and declared.modalities and runs_towers(model_type))
        or not has_mlx_lm_text_model(model_type)
    ):
        return False
    mm.language_model_only = True
    logger.warning(
        "vllm-metal does not run the vision/audio towers of model=%r (%s): serving its language "
        "model only; requests with images, video or audio are refused (HTTP 400). Families whose "
        "towers run here: %s",
        model.model,
        model_type,
        ", ".join(_families_with_towers_here()),
    )
    return True


def _families_with_towers_here() -> list[str]:
    """The vision-language families whose towers run on this host."""
    families = model_types("vision_language") + model_types("vision_state_hybrid")
    return [model_type for model_type in families if runs_towers(model_type)]


def limit_to_encoded_modalities(vllm_config: VllmConfig) -> None:
    """Set vLLM's per-prompt limit to 0 for the modalities a vision-language family does not
    declare and the user did not ask for; video token pruning is a MetalConfigError."""
    from vllm.config.multimodal import (
        AudioDummyOptions,
        ImageDummyOptions,
        VideoDummyOptions,
    )

    model = vllm_config.model_config
    mm = None if model is None else model.multimodal_config
    model_type = None if model is None else getattr(model.hf_config, "model_type", None)
    towers = model_types("vision_language") + model_types("vision_state_hybrid")
    if mm is None or model_type not in towers:
        return
    if mm.video_pruning_rate:
        raise MetalConfigError(
            f"vllm-metal: --video-pruning-rate {mm.video_pruning_rate} is not supported for "
            f"model={model.model!r} ({model_type}): the MLX runner places every video token; "
            "remove --video-pruning-rate"
        )
    encoded = declarations()[model_type].modalities
    options = {"image": ImageDummyOptions, "video": VideoDummyOptions, "audio": AudioDummyOptions}
    for modality in MODALITIES:
        if modality not in encoded and modality not in mm.limit_per_prompt:
            mm.limit_per_prompt[modality] = options[modality](count=0)


def keep_media_spans_whole(vllm_config: VllmConfig) -> None:
    """Set vLLM's `disable_chunked_mm_input` for a prefix-LM model that takes media items."""
    model = vllm_config.model_config
    mm = None if model is None else model.multimodal_config
    if mm is None or mm.language_model_only or not model.is_mm_prefix_lm:
        return
    scheduler = vllm_config.scheduler_config
    if not scheduler.disable_chunked_mm_input:
        scheduler.disable_chunked_mm_input = True
        logger.info(
            "model=%r attends over each image's tokens both ways: the scheduler keeps an image's "
            "tokens in one step (disable_chunked_mm_input)",
            model.model,
        )


def rewrite(vllm_config: VllmConfig) -> None:
    """The multimodal rewrites, in the order the capability table needs them (before it)."""
    serve_language_model_only(vllm_config)
    limit_to_encoded_modalities(vllm_config)
    keep_media_spans_whole(vllm_config)
