"""Verification of drafts: on the device where every row is greedy and nothing else acts on the
logits (`verifies_on_device`, `greedy_verified`), else with vLLM's own `RejectionSampler`.

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
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.batch import PackedBatch, ranges

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata

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


def verifies_on_device(metadata: SamplingMetadata, prompt_logprobs: bool) -> bool:
    """Whether a step's drafts are verified from its rows' argmax on the device: every row
    greedy, and nothing the `RejectionSampler` would apply first (penalties, bad words, allowed
    tokens, a minimum length, a logit bias, a thinking budget, a custom processor), no logprobs
    and no prompt logprobs. A grammar, known only when the step is sampled, sends it back."""
    processors = metadata.logitsprocs
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    return (
        metadata.all_greedy
        and metadata.no_penalties
        and not metadata.bad_words_token_ids
        and metadata.allowed_token_ids_mask is None
        and metadata.max_num_logprobs is None
        and not prompt_logprobs
        and not (holder is not None and holder.has_tracked_requests())
        and not any(_acts(p) for p in processors.non_argmax_invariant)
    )


def _acts(processor) -> bool:
    """Whether a processor that may move the argmax does anything this step (vLLM's own min
    tokens and logit bias only while some row has them; any other always)."""
    if isinstance(processor, MinTokensLogitsProcessor):
        return bool(processor.min_toks)
    if isinstance(processor, LogitBiasLogitsProcessor):
        return bool(processor.biases)
    return True


def greedy_verified(
    argmax: np.ndarray, packed: PackedBatch, batch: InputBatch, vocab_size: int
) -> list[list[int]]:
    """Each request's output tokens from its rows' argmax (`[S + drafts]`, the rows of
    `[last sampled, d1..dk]`): the argmax of each row while the draft it scores equals it, then
    the first that differs, or the last row's (the bonus token) when every draft matched; `[]`
    for a row mid-prefill. vLLM's greedy rejection sampling, placeholders (-1) rejected and
    tokens past the vocabulary dropped as its `parse_output` drops them."""
    num_draft = packed.num_draft_tokens.astype(np.int64)
    num_reqs = len(num_draft)
    first_row = np.cumsum(num_draft + 1) - (num_draft + 1)
    drafts = np.fromiter(
        (t for i in range(num_reqs) for t in batch.spec_token_ids[i][: num_draft[i]]),
        dtype=np.int64,
        count=int(num_draft.sum()),
    )
    offset = ranges(num_draft)
    owner = np.repeat(np.arange(num_reqs), num_draft)
    matched = np.zeros((num_reqs, int(num_draft.max(initial=0))), dtype=bool)
    matched[owner, offset] = argmax[first_row[owner] + offset] == drafts
    accepted = np.cumprod(matched, axis=1).sum(axis=1)  # leading matches
    out = []
    for i in range(num_reqs):
        if packed.discard[i]:
            out.append([])
            continue
        tokens = argmax[first_row[i] : first_row[i] + accepted[i] + 1]
        out.append(tokens[tokens < vocab_size].tolist())
    return out
