"""Models of the MLX backend: loaders by checkpoint format, adapters by `model_type`.

`load_model` reads a checkpoint with the loader for its format (`loaders/`) and wraps the model in
the adapter for its family (`families/`, the generic `ModelAdapter` otherwise). The runner only
talks to the adapter: embeddings, a forward over hidden states, logits and the layer kinds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.families import adapter_class
from vllm_metal.models.layers import LayerKind

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["LayerKind", "ModelAdapter", "load_model"]


def load_model(
    model: str,
    *,
    compute_dtype: mx.Dtype,
    revision: str | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    dequantize: bool = False,
) -> ModelAdapter:
    """Load `model` (a local directory or Hugging Face id) and wrap it for the runner."""
    from vllm_metal.models.loaders import safetensors

    mlx_model, config = safetensors.load(
        model,
        compute_dtype,
        revision=revision,
        download_dir=download_dir,
        trust_remote_code=trust_remote_code,
        dequantize=dequantize,
    )
    adapter = adapter_class(config.get("model_type"))(mlx_model, config)
    adapter.install_paged_attention()
    return adapter
