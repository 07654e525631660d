"""Encoder outputs of images (and other media) and where they go in a step's packed tokens.

vLLM's processor turns each image of a prompt into one `MultiModalFeatureSpec`: the pixel
tensors (`data`), a cache key (`identifier`, the image's content hash) and its placeholder span
in the prompt (`mm_position`: `offset`, `length` and `is_embed`, the positions inside the span that
take encoder rows). The scheduler decides when an item is encoded (`scheduled_encoder_inputs`,
within the encoder budget, before the step that first reaches its span) and when its output can
go (`free_encoder_mm_hashes`). In between, the output waits here under its identifier, so a long
image span split by chunked prefill is encoded once, and two requests with the same image share
one entry.

`EncoderCache.step_rows` turns the cached outputs into the rows of one step: for every packed
token inside a placeholder span whose `is_embed` is set, the encoder row it takes. The forward
writes those rows over the token embeddings (`forward.hidden_states`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.models.multimodal import TokenRows

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.models.multimodal import MultimodalAdapter


def item_tensors(item: MultiModalKwargsItem) -> dict[str, np.ndarray]:
    """The processor's tensors of one item as numpy arrays (floating ones as float32)."""
    import torch

    out = {}
    for name, value in item.get_data().items():
        if isinstance(value, torch.Tensor):
            value = value.float() if value.is_floating_point() else value
            out[name] = value.numpy()
        else:
            out[name] = np.asarray(value)
    return out


class EncoderCache:
    def __init__(self) -> None:
        self.outputs: dict[str, mx.array] = {}  # identifier -> [num_embeds, hidden]

    def __len__(self) -> int:
        return len(self.outputs)

    def clear(self) -> None:
        self.outputs.clear()

    def update(
        self,
        scheduler_output: SchedulerOutput,
        requests: Mapping[str, CachedRequestState],
        adapter: MultimodalAdapter,
    ) -> None:
        """Drop the outputs the scheduler freed, then encode the items it scheduled (one batch
        per modality). Lazy: the encoder runs with the step's graph."""
        for identifier in scheduler_output.free_encoder_mm_hashes:
            self.outputs.pop(identifier, None)
        pending: dict[str, list[MultiModalFeatureSpec]] = {}
        seen = set(self.outputs)
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for index in indices:
                feature = requests[req_id].mm_features[index]
                if feature.identifier in seen:
                    continue  # the same image in two requests of one step is encoded once
                seen.add(feature.identifier)
                if feature.data is None:
                    raise RuntimeError(
                        f"request {req_id}: {feature.modality} item {index} was scheduled for "
                        "encoding without its data"
                    )
                pending.setdefault(feature.modality, []).append(feature)
        for modality, features in pending.items():
            outputs = adapter.embed_multimodal(modality, [item_tensors(f.data) for f in features])
            for feature, output in zip(features, outputs):
                expected = feature.mm_position.get_num_embeds()
                if output.shape[0] != expected:
                    raise ValueError(
                        f"the {modality} encoder gave {output.shape[0]} rows for an item whose "
                        f"placeholder takes {expected}"
                    )
                self.outputs[feature.identifier] = output

    def step_rows(
        self, packed: PackedBatch, requests: Mapping[str, CachedRequestState]
    ) -> TokenRows | None:
        """The encoder rows of `packed`'s tokens that fall on placeholder positions, or None
        when no scheduled token does."""
        dest: list[np.ndarray] = []
        parts: list[mx.array] = []
        ends = packed.seq_lens
        for i, req_id in enumerate(packed.req_ids):
            begin, end = int(ends[i] - packed.num_scheduled[i]), int(ends[i])
            for feature in requests[req_id].mm_features or ():
                span = _overlap(feature, begin, end)
                if span is None:
                    continue
                where, first, last = span
                output = self.outputs.get(feature.identifier)
                if output is None:
                    raise RuntimeError(
                        f"request {req_id}: the encoder output of its {feature.modality} at "
                        f"position {feature.mm_position.offset} is not cached"
                    )
                dest.append(packed.cu_seqlens_q[i] + (where - begin))
                parts.append(output[first:last])
        if not dest:
            return None
        return TokenRows(
            dest=np.concatenate(dest).astype(np.int32),
            rows=mx.concatenate(parts) if len(parts) > 1 else parts[0],
        )


def _overlap(
    feature: MultiModalFeatureSpec, begin: int, end: int
) -> tuple[np.ndarray, int, int] | None:
    """For the scheduled window [begin, end) of a request: the prompt positions in it that take
    rows of `feature`'s output, and the range [first, last) of those rows; None if there are none."""
    place = feature.mm_position
    lo = max(begin, place.offset)
    hi = min(end, place.offset + place.length)
    if lo >= hi:
        return None
    first, last = place.get_embeds_indices_in_range(lo - place.offset, hi - place.offset)
    if first == last:
        return None
    positions = np.arange(lo, hi, dtype=np.int64)
    if place.is_embed is not None:
        mask = place.is_embed[lo - place.offset : hi - place.offset].numpy().astype(bool)
        positions = positions[mask]
    return positions, first, last


def merge(embeds: mx.array, step: TokenRows | None) -> mx.array:
    """`embeds` ([T, 1, hidden]) with the step's encoder rows written at their tokens (their
    first `hidden` columns)."""
    if step is None:
        return embeds
    rows = step.rows[:, None, : embeds.shape[-1]]
    embeds[mx.array(step.dest)] = rows.astype(embeds.dtype)
    return embeds
