"""Proves the per-request check refuses prompt embeddings (which the MLX runner cannot run) with a
client error naming the parameter, and lets token and text prompts through.
"""

from __future__ import annotations

import pytest
import torch
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import embeds_input, tokens_input
from vllm.sampling_params import SamplingParams

from vllm_metal.config.requests import PROMPT_EMBEDS_REFUSAL, validate_request


def test_token_prompts_pass():
    validate_request(tokens_input([1, 2, 3], prompt="abc"), SamplingParams(max_tokens=4))


def test_prompt_embeds_are_refused_as_a_client_error():
    with pytest.raises(VLLMClientError) as info:
        validate_request(embeds_input(torch.zeros(3, 8)), SamplingParams(max_tokens=4))
    assert PROMPT_EMBEDS_REFUSAL in str(info.value)
    assert "prompt_embeds" in str(info.value)
