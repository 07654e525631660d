"""Patch of vLLM's GPT-OSS MXFP4 config class: every activation dtype of the platform accepted.

GPT-OSS's published checkpoints store their experts in MXFP4 with `quant_method: mxfp4` in
`quantization_config`; vLLM renames that `gpt_oss_mxfp4` and then, while it builds its config,
refuses every activation dtype but bfloat16 (its CUDA kernels' limit). mlx-lm loads the MXFP4
blocks natively (`mx.quantize(..., mode="mxfp4")` layout) and computes in any of the platform's
dtypes; the class is only consulted for that check (the MLX runner builds no vLLM layer from it).
Run from `MetalPlatform.verify_quantization`, before vLLM checks the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_act_dtypes(quant: str, dtypes: Sequence[torch.dtype]) -> None:
    """Make vLLM's config class of the method `quant` accept `dtypes`."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    config_class = get_quantization_config(quant)
    config_class.get_supported_act_dtypes = classmethod(lambda cls: list(dtypes))
