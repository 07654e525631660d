"""The public native ops: paged KV-cache writes (reshape_and_cache), paged attention, the
state-layer ops of hybrid models (causal_conv1d, gated_delta_rule, mamba2_scan), multi-head
latent attention with its latent-cache write (mla_attention, mla_reshape_and_cache), and the
rotary position embedding of queries and keys (rotary_embedding).

One folder per op (attention/, cache/, short_conv/, gated_delta/, mamba2/, mla/, rope/) holds
its validated entry point, which states the contract, and its pure-MLX reference. Calls run the
compiled extension vllm_metal._C when it is built for this MLX, otherwise, or with
VLLM_METAL_USE_REFERENCE_OPS=1, the reference. The constants below come from csrc/constants.h
(through _C, or the header itself when _C is absent).
"""

from __future__ import annotations

from vllm_metal.ops import reference
from vllm_metal.ops._backend import (
    backend,
    native_available,
    native_unavailable_reason,
    set_value_checks,
)
from vllm_metal.ops._constants import BLOCK_SIZE_MULTIPLE, FLOAT_DTYPES, HEAD_SIZES, MLA_SIZES
from vllm_metal.ops.attention import paged_attention
from vllm_metal.ops.cache import reshape_and_cache
from vllm_metal.ops.gated_delta import gated_delta_rule
from vllm_metal.ops.mamba2 import mamba2_scan
from vllm_metal.ops.mla import mla_attention, mla_reshape_and_cache
from vllm_metal.ops.rope import rotary_embedding
from vllm_metal.ops.short_conv import causal_conv1d

__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "FLOAT_DTYPES",
    "HEAD_SIZES",
    "MLA_SIZES",
    "backend",
    "causal_conv1d",
    "gated_delta_rule",
    "mamba2_scan",
    "mla_attention",
    "mla_reshape_and_cache",
    "native_available",
    "native_unavailable_reason",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "rotary_embedding",
    "set_value_checks",
]
