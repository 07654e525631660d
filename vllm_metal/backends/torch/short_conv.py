"""vLLM's short-convolution layer (`ShortConv`, LFM2's conv layers) on the torch backend: the gated
causal convolution through the torch op ``vllm_metal::causal_conv1d`` (`kernels.causal_conv1d`:
the C++ driver of csrc/ops/short_conv/ on `cpu`, torch ops on `mps`), each request's window read
from and written back to vLLM's state pages in place.

vLLM's `ShortConv` runs its Triton/CUDA kernels on every platform that is not its CPU platform,
which an out-of-tree platform is not. Registering `MetalShortConv` out of tree
(`PluggableLayer.register_oot`) makes vLLM build it instead. Per step it keeps vLLM's contract:
the layer's state is vLLM's Mamba-style page per request (`MambaSpec`, the window of the last
``K - 1`` inputs ``[K - 1, C]``, bound by `MambaBase.bind_kv_cache`), addressed by the state
indices of vLLM's short-conv metadata, decodes first, then prefills (possibly a later chunk of a
prompt, continuing from its window; a first chunk starts from zeros). The metadata builder is
vLLM's, without the Triton launch tables it would compute for every prefill.

The state is kept one window per request (vLLM's mamba cache mode "none"): `configure` turns
prefix caching off for these models on this backend (vLLM's "align" mode, one window per cached
block, copies states with Triton kernels this backend does not have), with a log line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.v1.attention.backends.short_conv_attn import (
    ShortConvAttentionBackend,
    ShortConvAttentionMetadata,
    ShortConvAttentionMetadataBuilder,
)

from vllm_metal._logging import init_logger
from vllm_metal.backends.torch import kernels

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


class MetalShortConvMetadataBuilder(ShortConvAttentionMetadataBuilder):
    # The Triton kernel's launch tables (a Python loop over every prefill's tokens) are not used.
    needs_causal_conv1d_metadata = False


class MetalShortConvBackend(ShortConvAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[MetalShortConvMetadataBuilder]:
        return MetalShortConvMetadataBuilder


class MetalShortConv(ShortConv):
    def get_attn_backend(self) -> type[MetalShortConvBackend]:
        return MetalShortConvBackend

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, dict):
            metadata = metadata.get(self.prefix)
        bcx, _ = self.in_proj(hidden_states)
        b, c, x = bcx.chunk(3, dim=-1)
        if metadata is None:  # the profiling step runs without state pages
            output[: hidden_states.shape[0]], _ = self.out_proj(c * b * x)
            return
        assert isinstance(metadata, ShortConvAttentionMetadata)
        if metadata.num_accepted_tokens is not None:
            raise ValueError("vllm-metal (torch backend): speculative decoding is not supported")
        num_tokens = metadata.num_decode_tokens + metadata.num_prefill_tokens
        indices, has_state, cu_seqlens = _sequences(metadata, hidden_states.device)
        bx = b[:num_tokens] * x[:num_tokens]
        conv_out = torch.empty_like(bx)
        weight = self.conv.weight.view(self.conv.weight.shape[0], self.conv.weight.shape[-1])
        conv_state = self.kv_cache[0]  # [blocks, K - 1, C] (vLLM's default "SD" layout)
        if is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        kernels.causal_conv1d(
            bx, weight, self.conv.bias, conv_state, indices, has_state, cu_seqlens, conv_out
        )
        output[:num_tokens], _ = self.out_proj(c[:num_tokens] * conv_out)


def _sequences(
    metadata: ShortConvAttentionMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """State indices, has-state flags (None: all) and token offsets of the step's requests in
    batch order: the decodes (one token each, with a window), then the prefills."""
    num_decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    assert metadata.num_decode_tokens == num_decodes  # one token each without drafts
    indices, flags, offsets = [], [], []
    if num_decodes:
        assert metadata.state_indices_tensor_d is not None
        indices.append(metadata.state_indices_tensor_d[:num_decodes, 0])
        flags.append(torch.ones(num_decodes, dtype=torch.bool, device=device))
        offsets.append(torch.arange(num_decodes, dtype=torch.int32, device=device))
    if num_prefills:
        assert metadata.state_indices_tensor_p is not None
        assert metadata.query_start_loc_p is not None
        assert metadata.has_initial_states_p is not None
        indices.append(metadata.state_indices_tensor_p[:num_prefills])
        flags.append(metadata.has_initial_states_p[:num_prefills])
        offsets.append(metadata.query_start_loc_p[: num_prefills + 1] + num_decodes)
    else:
        offsets.append(torch.tensor([num_decodes], dtype=torch.int32, device=device))
    has_state = None if not num_prefills else torch.cat(flags)
    return (
        torch.cat(indices).to(torch.int32),
        has_state,
        torch.cat(offsets).to(torch.int32),
    )


def register() -> None:
    """Make vLLM build `MetalShortConv` for `ShortConv` in this process (once)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get(ShortConv.__name__) is not MetalShortConv:
        ShortConv.register_oot(MetalShortConv)


def configure(vllm_config: VllmConfig) -> None:
    """Cache settings of a short-convolution hybrid on the torch backend: one window per request
    (prefix caching off, with a log line); its dtype is checked at startup (`config.startup`)."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        logger.info(
            "vllm-metal: prefix caching is off for the hybrid model %r on the torch backend: its "
            "convolution layers keep one window per request, not per cached block "
            "(--no-enable-prefix-caching)",
            model.model,
        )
        cache.enable_prefix_caching = False
    cache.mamba_cache_mode = "none"
    cache.mamba_block_size = model.max_model_len
