"""M-RoPE positions of a step's tokens, for the models that place tokens on three streams.

A request's prompt positions depend on its media items' grids (and a video's timing) and are
computed once per prompt by the adapter (`MultimodalAdapter.mrope_positions`) and kept on vLLM's
`CachedRequestState` (`mrope_positions`, `mrope_position_delta`, the fields vLLM's own runner
uses). A token past the prompt (an output, a draft) sits at its index plus the request's offset
on all three streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from vllm_metal.backends.mlx.runner.mm.embeddings import item_tensors

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.models.multimodal import MultimodalAdapter


def step_positions(
    packed: PackedBatch,
    requests: Mapping[str, CachedRequestState],
    adapter: MultimodalAdapter,
) -> np.ndarray:
    """The three position streams of every packed token (`[3, T]` int32)."""
    out = np.empty((3, packed.num_tokens), dtype=np.int32)
    for i, req_id in enumerate(packed.req_ids):
        start, stop = packed.cu_seqlens_q[i], packed.cu_seqlens_q[i + 1]
        table, delta = _prompt_positions(requests[req_id], adapter)
        index = packed.positions[start:stop]
        in_prompt = index < table.shape[1]
        prompt = table[:, np.minimum(index, table.shape[1] - 1)]
        out[:, start:stop] = np.where(in_prompt, prompt, index + delta)
    return out


def _prompt_positions(
    state: CachedRequestState, adapter: MultimodalAdapter
) -> tuple[np.ndarray, int]:
    """The request's prompt positions (`[3, prompt length]`) and later-token offset, computed
    when its prompt is new (a streaming session's next turn replaces the prompt)."""
    table = state.mrope_positions
    if table is None or table.shape[1] != len(state.prompt_token_ids):
        items = [
            (f.modality, item_tensors(f.data))
            for f in state.mm_features or ()
            if f.data is not None
        ]
        table, delta = adapter.mrope_positions(list(state.prompt_token_ids), items)
        state.mrope_positions, state.mrope_position_delta = table, delta
    return table, int(state.mrope_position_delta)
