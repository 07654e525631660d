"""Verification of drafts with vLLM's own `RejectionSampler`.

A request verifying k drafts has k+1 logits rows, in request order: the rows of
`[last sampled, d1..dk]`, so row j scores draft j+1 and the last row gives the bonus token. The
sampler accepts drafts by vLLM's rules (greedy: while the draft is the argmax; random: with
probability min(1, p_target/p_draft), else a token from the residual distribution), which keeps
the output distribution of non-speculative sampling. Seeded sampled rows are then verified by
position (`seeded.py`), which keeps their tokens those of decoding without drafts. Its Triton
kernels run as the torch implementations in `kernels.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.batch import PackedBatch, ranges

if TYPE_CHECKING:
    from vllm_metal.backends.mlx.runner.request_state import RequestStates


def spec_decode_metadata(packed: PackedBatch, batch: InputBatch) -> SpecDecodeMetadata:
    """vLLM's metadata for the step's logits rows (indices into `[S + drafts, V]`)."""
    num_draft = packed.num_draft_tokens.astype(np.int32)
    num_sampled = num_draft + 1
    cu_sampled = np.cumsum(num_sampled, dtype=np.int32)
    first_row = cu_sampled - num_sampled
    target_rows = np.repeat(first_row, num_draft) + ranges(num_draft)
    # The drafts as the scheduler sent them: -1 placeholders stay -1 and are always rejected.
    drafts = [batch.spec_token_ids[i] for i in range(len(num_draft))]
    draft_ids = np.fromiter((t for row in drafts for t in row), dtype=np.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.from_numpy(draft_ids),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(num_draft, dtype=np.int32)),
        cu_num_sampled_tokens=torch.from_numpy(cu_sampled),
        target_logits_indices=torch.from_numpy(target_rows.astype(np.int32)),
        bonus_logits_indices=torch.from_numpy(cu_sampled - 1),
        logits_indices=torch.from_numpy(packed.logits_indices.astype(np.int32)),
    )


def verify(
    sampler: RejectionSampler,
    logits: torch.Tensor,
    packed: PackedBatch,
    states: RequestStates,
) -> tuple[list[list[int]], LogprobsLists | None]:
    """Each request's output tokens (accepted drafts + one bonus or recovered token; `[]` for a
    row mid-prefill) and their logprobs. Seeded sampled rows are verified by position instead
    (`seeded.resample_drafts`), so their tokens are those of decoding without drafts."""
    batch = states.input_batch
    metadata = spec_decode_metadata(packed, batch)
    output = sampler(metadata, None, logits, batch.sampling_metadata)
    seeded.resample_drafts(sampler.sampler, logits, metadata, output.sampled_token_ids, states)
    discard = np.nonzero(packed.discard)[0].tolist()
    return RejectionSampler.parse_output(
        output.sampled_token_ids, states.vocab_size, discard, output.logprobs_tensors
    )
