"""The pure-MLX reference ops, each defined beside its op (attention/, cache/, short_conv/,
gated_delta/, mamba2/, mla/, rope/): test oracles and the implementation used when the native
extension is not built."""

from vllm_metal.ops.attention.reference import gather_sequence_kv, paged_attention
from vllm_metal.ops.cache.reference import reshape_and_cache
from vllm_metal.ops.gated_delta.reference import gated_delta_rule
from vllm_metal.ops.mamba2.reference import mamba2_scan
from vllm_metal.ops.mla.reference import mla_attention, mla_reshape_and_cache
from vllm_metal.ops.rope.reference import rotary_embedding
from vllm_metal.ops.short_conv.reference import causal_conv1d

__all__ = [
    "causal_conv1d",
    "gated_delta_rule",
    "gather_sequence_kv",
    "mamba2_scan",
    "mla_attention",
    "mla_reshape_and_cache",
    "paged_attention",
    "reshape_and_cache",
    "rotary_embedding",
]
