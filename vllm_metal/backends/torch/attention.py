"""vLLM attention backend of the torch backend: this project's paged kernels over vLLM's KV pages.

vLLM 0.32 allocates each layer's KV cache itself, as one page of bytes per block in the layout the
engine resolved from what backends declare (`supported_kv_cache_layouts`); this backend declares
`vllm_metal.kv.KV_CACHE_LAYOUT` and reads each page as K rows then V rows,
``[2, block_size, kv_heads, head_size]``, the pool shape the kernels take (`page_views`).
Per step the builder keeps vLLM's common metadata (query offsets, context lengths, block table,
slot mapping); the layer writes its new K/V rows at their slots (`do_kv_cache_update`) and then
attends through `kernels.paged_attention` (the C++ CPU driver on the `cpu` device, plain torch ops
on `mps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_metal import ops
from vllm_metal.backends.torch import kernels
from vllm_metal.kv import KV_CACHE_LAYOUT

# The name vLLM's selector and KV connectors know this backend by (an AttentionBackendEnum
# member, registered in every process that imports this module).
BACKEND_NAME = "METAL_PAGED"


class MetalPagedAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[MetalPagedAttentionImpl]:
        return MetalPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MetalPagedMetadataBuilder]:
        return MetalPagedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(ops.BLOCK_SIZE_MULTIPLE)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout[KV_CACHE_LAYOUT],)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


if BACKEND_NAME not in AttentionBackendEnum.__members__:
    register_backend(
        BACKEND_NAME, f"{MetalPagedAttentionBackend.__module__}.MetalPagedAttentionBackend"
    )


@dataclass
class MetalPagedMetadata:
    """One step of one KV-cache group, as the kernels take it (int32 tables, int64 slots)."""

    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [S + 1]
    seq_lens: torch.Tensor  # [S], context length after this step
    block_table: torch.Tensor  # [S, max_blocks]
    slot_mapping: torch.Tensor  # [T]


class MetalPagedMetadataBuilder(AttentionMetadataBuilder[MetalPagedMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> MetalPagedMetadata:
        m = common_attn_metadata
        if not m.causal:
            raise ValueError("vllm-metal (torch backend): non-causal attention is not supported")
        num_reqs = m.num_reqs
        return MetalPagedMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc[: num_reqs + 1],
            seq_lens=m.seq_lens[:num_reqs],
            block_table=m.block_table_tensor[:num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
        )


def page_views(
    kv_cache: torch.Tensor, num_kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools ``[blocks, block_size, kv_heads, head_size]`` over vLLM's per-layer cache.

    `kv_cache` is vLLM's logical ``[blocks, kv_heads, block_size, 2 * head_size]`` view of the
    layer's pages; only its block stride and the page start matter here (a page may be padded).
    """
    blocks, _, block_size, _ = kv_cache.shape
    rows = block_size * num_kv_heads * head_size
    if kv_cache.stride(0) < 2 * rows:
        raise ValueError(
            f"KV cache page of {kv_cache.stride(0)} elements cannot hold {2 * rows} (K and V of "
            f"{block_size} tokens x {num_kv_heads} heads x {head_size})"
        )
    size = (blocks, block_size, num_kv_heads, head_size)
    stride = (kv_cache.stride(0), num_kv_heads * head_size, head_size, 1)
    start = kv_cache.storage_offset()
    key = torch.as_strided(kv_cache, size, stride, start)
    value = torch.as_strided(kv_cache, size, stride, start + rows)
    return key, value


class MetalPagedAttentionImpl(AttentionImpl[MetalPagedMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if alibi_slopes is not None:
            raise ValueError("vllm-metal (torch backend): ALiBi attention is not supported")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"vllm-metal (torch backend): attn_type={attn_type} is not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = int(sliding_window or 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._views: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _pools(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The layer's cache tensor lives as long as the KV cache config: view it once.
        if self._views is None or self._views[0] != kv_cache.data_ptr():
            key, value = page_views(kv_cache, self.num_kv_heads, self.head_size)
            self._views = (kv_cache.data_ptr(), key, value)
        return self._views[1], self._views[2]

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if kv_cache.numel() == 0:
            return
        key_cache, value_cache = self._pools(kv_cache)
        n = slot_mapping.shape[0]
        kernels.reshape_and_cache(key[:n], value[:n], key_cache, value_cache, slot_mapping)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: MetalPagedMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("vllm-metal (torch backend): quantized attention output")
        if attn_metadata is None:  # the profiling step runs without a cache
            return output.zero_()
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._pools(kv_cache)
        kernels.paged_attention(
            output[:n],
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            scale=self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        return output
