"""LoRA adapters on the MLX runner (docs/lora.md): Hugging Face PEFT checkpoints read with vLLM's
helpers (`checkpoint`), the decoder's linear projections wrapped with device slots (`layer`), and
the host cache, slot assignment and per-step token mapping (`manager`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.backends.mlx.runner.lora.manager import LoRAManager

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.config import VllmConfig

__all__ = ["LoRAManager", "make_lora_manager"]


def make_lora_manager(vllm_config: VllmConfig, compute_dtype: mx.Dtype) -> LoRAManager | None:
    """The manager for `--enable-lora`, None without it."""
    lora_config = vllm_config.lora_config
    if lora_config is None:
        return None
    from vllm_metal.backends.mlx.dtypes import to_mlx_dtype

    # vLLM resolves "auto" to the model's dtype; the projections compute in compute_dtype.
    dtype = lora_config.lora_dtype
    if dtype in (None, "auto") or dtype == vllm_config.model_config.dtype:
        dtype = compute_dtype
    else:
        dtype = to_mlx_dtype(dtype)
    hf_config = vllm_config.model_config.hf_text_config
    return LoRAManager(
        lora_config,
        dtype,
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", None),
    )
