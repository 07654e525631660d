"""How vLLM's multimodal front end and scheduler are set up for what the MLX runner encodes.

A Mistral 3, Pixtral or Qwen2-VL checkpoint carries a language model that mlx-lm loads by itself
(its `mistral3`, `pixtral`, `qwen2_vl`, ... modules drop the vision weights). Until the runner runs
such a family's tower (`capabilities.VISION_LANGUAGE_MODEL_TYPES`), the platform serves the
language model and sets vLLM's `language_model_only`: the front end then answers a request that
carries an image, video or audio item with a 400 ("At most 0 image(s) may be provided in one
prompt"), before it reaches the engine. A multimodal checkpoint without such an mlx-lm module is
refused at startup by the `multimodal` capability row.

A family whose towers run but encode only some modalities (Idefics3, Gemma 3: images, not video)
gets a limit of 0 for the others, so vLLM's front end answers such a request with a 400 as well;
asking for more with `--limit-mm-per-prompt` is refused at startup.

In a prefix-LM family (Gemma 3: vLLM's `is_mm_prefix_lm`) the tokens of one image attend to each
other both ways, so every token of an image must be in the step that attends over them: the
scheduler is told not to cut an image across steps (`disable_chunked_mm_input`).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from vllm_metal._logging import init_logger
from vllm_metal.capabilities import (
    SPEECH_TO_TEXT_MODEL_TYPES,
    VISION_LANGUAGE_MODALITIES,
    VISION_LANGUAGE_MODEL_TYPES,
    MetalConfigError,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


def has_mlx_lm_text_model(model_type: str | None) -> bool:
    """Whether mlx-lm has a module for `model_type` (for a multimodal checkpoint: the module that
    loads its language model alone)."""
    if not model_type or not model_type.isidentifier():
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None


def serve_language_model_only(vllm_config: VllmConfig) -> bool:
    """Set `language_model_only` for a multimodal checkpoint whose language model mlx-lm loads and
    whose towers the runner does not run; whether it did."""
    model = vllm_config.model_config
    if model is None or not model.is_multimodal_model or model.is_encoder_decoder:
        return False
    mm = model.multimodal_config
    model_type = getattr(model.hf_config, "model_type", None)
    if (
        mm is None
        or mm.language_model_only
        or model_type in VISION_LANGUAGE_MODEL_TYPES
        or model_type in SPEECH_TO_TEXT_MODEL_TYPES
        or not has_mlx_lm_text_model(model_type)
    ):
        return False
    mm.language_model_only = True
    logger.warning(
        "vllm-metal does not run the vision/audio towers of model=%r (%s): serving its language "
        "model only; requests with images, video or audio are refused (HTTP 400). Families whose "
        "towers run: %s",
        model.model,
        model_type,
        ", ".join(VISION_LANGUAGE_MODEL_TYPES),
    )
    return True


# The media kinds vLLM's processors take.
MODALITIES = ("image", "video", "audio")


def limit_to_encoded_modalities(vllm_config: VllmConfig) -> None:
    """Set vLLM's per-prompt limit to 0 for the modalities a served family's towers do not
    encode; a limit above 0 asked for one of them, or video token pruning, is a
    MetalConfigError naming the flag."""
    from vllm.config.multimodal import (
        AudioDummyOptions,
        ImageDummyOptions,
        VideoDummyOptions,
    )

    model = vllm_config.model_config
    mm = None if model is None else model.multimodal_config
    model_type = None if model is None else getattr(model.hf_config, "model_type", None)
    if mm is None or model_type not in VISION_LANGUAGE_MODALITIES:
        return
    if mm.video_pruning_rate:
        raise MetalConfigError(
            f"vllm-metal: --video-pruning-rate {mm.video_pruning_rate} is not supported for "
            f"model={model.model!r} ({model_type}): the MLX runner places every video token; "
            "remove --video-pruning-rate"
        )
    encoded = VISION_LANGUAGE_MODALITIES[model_type]
    options = {"image": ImageDummyOptions, "video": VideoDummyOptions, "audio": AudioDummyOptions}
    for modality in MODALITIES:
        if modality in encoded:
            continue
        asked = mm.limit_per_prompt.get(modality)
        if asked is not None and asked.count > 0:
            raise MetalConfigError(
                f"vllm-metal: --limit-mm-per-prompt {modality}={asked.count} is not supported "
                f"for model={model.model!r} ({model_type}): its {modality} inputs are not run "
                f"yet, only {', '.join(encoded)}; remove {modality!r} from the limits"
            )
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
