"""Prepacked GEMMs for the torch backend's cpu device.

vLLM's CPU backend does not run its unquantized linear layers through `F.linear`: after
loading it reorders each weight once into oneDNN's blocked layout
(`dispatch_cpu_unquantized_gemm`) and every step multiplies against that. vLLM keys that on
its own CPU platform, which this plugin is not, so on the cpu device the runner applies the
same dispatch to the loaded model here. On `mps` nothing changes: MPS matmuls take the
weights as loaded.

Only plain 2-D weights are packed. LFM2's short-conv weight (3-D) stays as loaded, because
MetalShortConv reads it directly.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from vllm_metal._logging import init_logger

logger = init_logger(__name__)


class _PackedProduct:
    """The layer's product goes through the packed weight in `layer.cpu_linear`."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return layer.cpu_linear(x, layer.weight, bias)


class _PackedLinearMethod(_PackedProduct, UnquantizedLinearMethod):
    """A linear layer multiplied through its packed weight."""


class _PackedEmbeddingMethod(_PackedProduct, UnquantizedEmbeddingMethod):
    """An LM head whose logits product goes through its packed weight; the lookup keeps the
    loaded table (a tied LM head is the embedding itself)."""


def _packable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and not weight.is_meta
        and weight.device.type == "cpu"
    )


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Give every unquantized 2-D linear layer and the LM head vLLM's CPU GEMM; returns how many.

    An embedding table is packed only when it is the LM head (tied or not): the lookup never
    uses the packed copy, and vLLM's CPU backend keeps the table beside it the same way.
    """
    lm_head = getattr(model, "lm_head", None)
    packed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not _packable(module):
            continue
        if type(method) is UnquantizedLinearMethod:
            dispatch_cpu_unquantized_gemm(module, remove_weight=True)
            module.quant_method = _PackedLinearMethod()
        elif type(method) is UnquantizedEmbeddingMethod and module is lm_head:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.quant_method = _PackedEmbeddingMethod()
        else:
            continue
        packed += 1
    logger.info("cpu device: %d linear layers use vLLM's CPU GEMM dispatch (prepacked)", packed)
    return packed
