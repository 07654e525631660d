"""Quantized checkpoint formats that vLLM names as quantization methods but the MLX loader reads
itself, so they are not vLLM kernels to refuse.

GPT-OSS's published checkpoints store their experts in MXFP4 with `quant_method: mxfp4` in
`quantization_config`; vLLM renames that `gpt_oss_mxfp4` and then, while it builds its config,
refuses every activation dtype but bfloat16 (its CUDA kernels' limit). mlx-lm loads the MXFP4
blocks natively (`mx.quantize(..., mode="mxfp4")` layout) and computes in any of the platform's
dtypes, so on this platform the method accepts them all (`accept_checkpoint_quantization`, run from
`MetalPlatform.verify_quantization`, before vLLM checks the dtype).
"""

from __future__ import annotations

CHECKPOINT_QUANTIZATIONS = frozenset({"gpt_oss_mxfp4"})


def accept_checkpoint_quantization(quant: str | None) -> None:
    """Make vLLM's config class of `quant` accept the platform's dtypes (no-op for others)."""
    if quant not in CHECKPOINT_QUANTIZATIONS:
        return
    from vllm.model_executor.layers.quantization import get_quantization_config

    from vllm_metal.platform import SUPPORTED_DTYPES

    config_class = get_quantization_config(quant)
    # The class is only consulted for this check: the MLX runner builds no vLLM layers from it.
    config_class.get_supported_act_dtypes = classmethod(lambda cls: list(SUPPORTED_DTYPES))
