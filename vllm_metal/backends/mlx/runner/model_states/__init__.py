"""Model kinds as strategies of the one runner (`interface.ModelState`): a decoder (`decoder`), a
decoder with towers (`multimodal`), an encoder (`encoder_only`), an encoder-decoder
(`encoder_decoder`). `select` picks the kind from vLLM's model config, before anything loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.backends.mlx.runner.model_states.interface import (
    FEATURE_FLAGS,
    NO_INPUTS,
    ModelState,
    StepInputs,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["FEATURE_FLAGS", "NO_INPUTS", "ModelState", "StepInputs", "select"]


def select(vllm_config: VllmConfig) -> type[ModelState]:
    """The kind of the model `vllm_config` serves: encoder-decoder (Whisper), encoder-only (BERT,
    XLM-RoBERTa), a vision-language decoder whose towers run, or a decoder."""
    from vllm_metal.backends.mlx.runner.model_states.decoder import language_model_only
    from vllm_metal.models import loads_towers

    model_config = vllm_config.model_config
    if model_config.is_encoder_decoder:
        from vllm_metal.backends.mlx.runner.model_states.encoder_decoder import (
            EncoderDecoderState,
        )

        return EncoderDecoderState
    if model_config.attn_type == "encoder_only":
        from vllm_metal.backends.mlx.runner.model_states.encoder_only import EncoderOnlyState

        return EncoderOnlyState
    # The rule `models.load_model` loads by.
    model_type = getattr(model_config.hf_config, "model_type", None)
    if loads_towers(model_config.model, model_type, language_model_only(model_config)):
        from vllm_metal.backends.mlx.runner.model_states.multimodal import MultimodalState

        return MultimodalState
    from vllm_metal.backends.mlx.runner.model_states.decoder import DecoderState

    return DecoderState
