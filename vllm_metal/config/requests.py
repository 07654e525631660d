"""Per-request checks for what the runners cannot serve, run by vLLM before a request is queued
(`MetalPlatform.validate_request`).

A refused request gets HTTP 400 with the message below; without the check it would fail inside the
engine core and take the server down. docs/serving.md lists every refusal.
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs.engine import split_enc_dec_input

PROMPT_EMBEDS_REFUSAL = (
    "vllm-metal: prompt embeddings (prompt_embeds) are not supported; "
    "send the prompt as text or token ids"
)


def validate_request(processed_inputs: Any, params: Any) -> None:
    """Raise `VLLMValidationError` (a 400 for the client) for a request the runners cannot run.

    `processed_inputs` is vLLM's rendered `EngineInput`, `params` its `SamplingParams` or
    `PoolingParams`; this is the body of `MetalPlatform.validate_request`.
    """
    # An encoder-decoder prompt reaches here only for a speech-to-text model: other
    # encoder-decoder models are refused at startup (`config.table`).
    _, decoder_input = split_enc_dec_input(processed_inputs)
    if decoder_input.get("type") == "embeds":
        raise VLLMValidationError(PROMPT_EMBEDS_REFUSAL, parameter="prompt_embeds")
