"""The pure-MLX reference ops, each defined beside its op (attention/, cache/): test oracles and
the implementation used when the native extension is not built."""

from vllm_metal.ops.attention.reference import gather_sequence_kv, paged_attention
from vllm_metal.ops.cache.reference import reshape_and_cache

__all__ = ["gather_sequence_kv", "paged_attention", "reshape_and_cache"]
