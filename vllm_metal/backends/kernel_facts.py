"""What both backends take from this project's paged kernels: the head sizes they are built for,
the block-size multiple and the KV page layout (a base class of each backend's device facts)."""

from __future__ import annotations


class PagedKernelFacts:
    def head_sizes(self) -> tuple[int, ...]:
        from vllm_metal import ops

        return tuple(ops.HEAD_SIZES)

    def block_size_multiple(self) -> int:
        from vllm_metal import ops

        return int(ops.BLOCK_SIZE_MULTIPLE)

    def kv_cache_layouts(self) -> list[str]:
        from vllm_metal.kv import KV_CACHE_LAYOUT

        return [KV_CACHE_LAYOUT]
