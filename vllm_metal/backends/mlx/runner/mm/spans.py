"""How far each token of a step attends in prefix-LM models, where the tokens of one image see
each other both ways (Gemma 3; vLLM's `is_mm_prefix_lm`).

A media item's placeholder holds one or more runs of embedding tokens (`PlaceholderRange`'s
`is_embed`); each run is one bidirectional span, as transformers groups consecutive image tokens.
A token inside a span at position `p` attends up to the span's last token instead of `p` (the
paged op's `key_ends`); sliding-window layers still bound it from below at `p`. vLLM's scheduler
keeps a span within one step (`disable_chunked_mm_input`, set by the platform for these models),
so every key a span's tokens need is written by the time they attend; a span the step cuts
anyway reaches only the keys written so far.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from vllm_metal.backends.mlx.runner.batch import PackedBatch


def step_key_ends(
    packed: PackedBatch, requests: Mapping[str, CachedRequestState]
) -> np.ndarray | None:
    """`[T]` int32 key ends of the step's packed tokens (0 for causal tokens), or None when no
    token of the step lies inside a span."""
    ends = np.zeros(packed.num_tokens, dtype=np.int32)
    for i, req_id in enumerate(packed.req_ids):
        start, stop = int(packed.cu_seqlens_q[i]), int(packed.cu_seqlens_q[i + 1])
        features = requests[req_id].mm_features
        if start == stop or not features:
            continue
        positions = packed.positions[start:stop]
        written = int(packed.seq_lens[i])
        for feature in features:
            if feature.modality == "audio":  # audio stays causal, as in vLLM
                continue
            for first, last in feature.mm_position.extract_embeds_range():
                inside = (positions >= first) & (positions <= last)
                if inside.any():
                    ends[start:stop][inside] = min(last + 1, written)
    return ends if ends.any() else None
