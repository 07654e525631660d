"""Pipeline stages: the hidden states one stage hands the next, as vLLM's `IntermediateTensors`
(torch tensors on the host, which vLLM's pipeline group sends over gloo). The layer split and the
stage's forward are the adapter's (`models.adapter.LayerRange`, `forward_stage`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
from vllm.sequence import IntermediateTensors

from vllm_metal.backends.mlx.runner.tensors import to_torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

HIDDEN = "hidden_states"  # mlx-lm's layers add their residuals inside: one stream to hand on


def is_last(vllm_config: VllmConfig) -> bool:
    """Whether this worker runs the last stage (the only one that computes logits and samples)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size == 1:
        return True
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().is_last_rank


def to_next(hidden: mx.array, kv_arrays: list[mx.array]) -> IntermediateTensors:
    """The stage's output (`[T, 1, hidden]`) evaluated with its cache writes, as float32 (exact
    for every compute dtype, and numpy has no bfloat16)."""
    out = hidden.astype(mx.float32)
    mx.eval(out, *kv_arrays)
    return IntermediateTensors({HIDDEN: to_torch(out)})


def from_previous(tensors: IntermediateTensors, dtype: mx.Dtype) -> mx.array:
    """The previous stage's hidden states as this stage's input, in the compute dtype."""
    return mx.array(tensors[HIDDEN].numpy()).astype(dtype)
