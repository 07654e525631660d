"""Prompt logprobs: which packed rows need logits, and vLLM's gather of the top-k and the
prompt token's own logprob, accumulated across prefill chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors

from vllm_metal.backends.mlx.runner.batch import PackedBatch
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.tensors import to_torch

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.v1.sample.sampler import Sampler


def prompt_logprob_rows(states: RequestStates, packed: PackedBatch) -> dict[str, np.ndarray]:
    """Packed rows whose next token is still a prompt token, per request that asked."""
    rows: dict[str, np.ndarray] = {}
    batch = states.input_batch
    for req_id in states.num_prompt_logprobs:
        index = batch.req_id_to_index.get(req_id)
        if index is None:
            continue
        start = int(batch.num_computed_tokens_cpu[index])
        remaining = states.requests[req_id].num_prompt_tokens - (start + 1)
        count = min(int(packed.num_scheduled[index]), remaining)
        if count > 0:
            first = int(packed.cu_seqlens_q[index])
            rows[req_id] = np.arange(first, first + count, dtype=np.int32)
    return rows


def gather_prompt_logprobs(
    states: RequestStates,
    packed: PackedBatch,
    prompt_logits: dict[str, mx.array],
    sampler: Sampler,
    logprobs_mode: str,
) -> dict[str, LogprobsTensors | None]:
    """This step's prompt logprobs; a request's tensors are reported once its prompt is done."""
    if not states.num_prompt_logprobs:
        return {}
    out: dict[str, LogprobsTensors | None] = {}
    completed = []
    index_of = {req_id: i for i, req_id in enumerate(packed.req_ids)}
    for req_id, k in states.num_prompt_logprobs.items():
        index = index_of.get(req_id)
        if index is None:
            continue
        state = states.requests[req_id]
        num_prompt = state.num_prompt_tokens
        tensors = state.in_progress_prompt_logprobs_cpu
        if tensors is None:
            tensors = LogprobsTensors.empty_cpu(num_prompt - 1, k + 1)
            state.in_progress_prompt_logprobs_cpu = tensors
        n = int(packed.num_scheduled[index])
        start = int(packed.seq_lens[index]) - n
        if n > num_prompt - (start + 1):
            completed.append(req_id)
            out[req_id] = tensors
        rows = prompt_logits.get(req_id)
        if rows is None or rows.shape[0] == 0:
            continue
        logits = to_torch(rows)
        count = logits.shape[0]
        targets = torch.tensor(state.prompt_token_ids[start + 1 : start + 1 + count])
        if logprobs_mode in ("raw_logits", "processed_logits"):
            scores = logits
        else:
            scores = sampler.compute_logprobs(logits)
        token_ids, logprobs, ranks, *_ = sampler.gather_logprobs(scores, k, targets)
        span = slice(start, start + count)
        tensors.logprob_token_ids[span].copy_(token_ids)
        tensors.logprobs[span].copy_(logprobs)
        tensors.selected_token_ranks[span].copy_(ranks)
    for req_id in completed:
        del states.num_prompt_logprobs[req_id]
        states.requests[req_id].in_progress_prompt_logprobs_cpu = None
    return out
