"""Torch stand-ins for the four Triton kernels of vLLM's `RejectionSampler`.

Triton has no backend on macOS (nor on a CPU-only Linux host), so `RejectionSampler` cannot launch
`rejection_greedy_sample_kernel`, `rejection_random_sample_kernel`, `expand_kernel` or
`sample_recovered_tokens_kernel`. `register_rejection_kernels()` swaps them for the functions
below through vLLM's kernel dispatcher. Each function takes the kernel's own parameter names (so the
dispatcher forwards launch arguments by keyword), reproduces its semantics exactly and writes in
place into the output tensor it is given, whatever its dtype (unlike vLLM's CPU fallback, whose
expand leaves float outputs unwritten).
"""

from __future__ import annotations

import torch

_MODULE = "vllm.v1.sample.rejection_sampler"


def _request_spans(cu: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, count) per request from the inclusive cumulative counts."""
    ends = cu[:batch].to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends - starts


def _token_owner(cu: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every flat token index: the request it belongs to and its offset inside it."""
    starts, counts = _request_spans(cu, batch)
    tokens = torch.arange(int(cu[batch - 1]), device=cu.device)
    owner = torch.searchsorted(starts + counts, tokens, right=True)
    return owner, tokens - starts[owner]


def _draft_grid(cu: torch.Tensor, batch: int, num_tokens: int):
    """Per request: counts, a [batch, L] grid of flat indices (clamped), its validity, positions."""
    starts, counts = _request_spans(cu, batch)
    pos = torch.arange(int(counts.max()), device=cu.device)
    idx = (starts[:, None] + pos).clamp(max=max(num_tokens - 1, 0))
    return counts, idx, pos < counts[:, None], pos


def _write_accepted_prefix(output, rows, counts, valid, accepted, tokens, bonus) -> None:
    """Write `tokens` ([batch, L]) up to and including the first rejected position of each selected
    row, then the bonus token where every draft was accepted."""
    run = torch.cumprod(accepted.to(torch.int32), dim=1)
    # A position is written when every earlier position was accepted.
    alive = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], dim=1).bool()
    write = valid & alive & rows[:, None]
    output[:, : accepted.shape[1]][write] = tokens[write].to(output.dtype)
    finished = (rows & (run.sum(dim=1) == counts)).nonzero().squeeze(1)
    output[finished, counts[finished]] = bonus.reshape(-1)[finished].to(output.dtype)


def rejection_greedy_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    target_argmax_ptr,
    bonus_token_ids_ptr,
    is_greedy_ptr,
    max_spec_len,
    uniform_probs_ptr,
    synthetic_conditional_rates_ptr,
    SYNTHETIC_MODE,
):
    batch = output_token_ids_ptr.shape[0]
    if batch == 0:
        return
    rows = (
        torch.ones(batch, dtype=torch.bool, device=output_token_ids_ptr.device)
        if is_greedy_ptr is None
        else is_greedy_ptr[:batch].bool()
    )
    counts, idx, valid, pos = _draft_grid(
        cu_num_draft_tokens_ptr, batch, draft_token_ids_ptr.shape[0]
    )
    draft = draft_token_ids_ptr[idx].to(torch.int64)
    argmax = target_argmax_ptr[idx].to(torch.int64)
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        rate = rates[pos.clamp(max=rates.shape[0] - 1)]
        accepted = valid & (uniform_probs_ptr[idx] < rate) & (draft >= 0)
        tokens = torch.where(accepted, draft, argmax)
    else:
        accepted = valid & (draft == argmax)
        tokens = argmax
    _write_accepted_prefix(
        output_token_ids_ptr, rows, counts, valid, accepted, tokens, bonus_token_ids_ptr
    )


def rejection_random_sample(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    bonus_token_ids_ptr,
    recovered_token_ids_ptr,
    uniform_probs_ptr,
    is_greedy_ptr,
    max_spec_len,
    vocab_size,
    synthetic_conditional_rates_ptr,
    NO_DRAFT_PROBS,
    SYNTHETIC_MODE,
):
    batch = output_token_ids_ptr.shape[0]
    if batch == 0:
        return
    rows = ~is_greedy_ptr[:batch].bool()
    counts, idx, valid, pos = _draft_grid(
        cu_num_draft_tokens_ptr, batch, draft_token_ids_ptr.shape[0]
    )
    draft = draft_token_ids_ptr[idx].to(torch.int64)
    uniform = uniform_probs_ptr[idx]
    if SYNTHETIC_MODE:
        rates = synthetic_conditional_rates_ptr
        ok = uniform < rates[pos.clamp(max=rates.shape[0] - 1)]
    else:
        column = draft.clamp(min=0)
        target_p = target_probs_ptr[idx, column]
        if NO_DRAFT_PROBS:
            ok = target_p >= uniform
        else:
            draft_p = draft_probs_ptr[idx, column]
            ok = (draft_p > 0) & (target_p / draft_p >= uniform)
    accepted = valid & (draft >= 0) & ok
    tokens = torch.where(accepted, draft, recovered_token_ids_ptr[idx].to(torch.int64))
    _write_accepted_prefix(
        output_token_ids_ptr, rows, counts, valid, accepted, tokens, bonus_token_ids_ptr
    )


def expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS):
    batch = input_ptr.shape[0]
    if batch == 0:
        return
    owner, offset = _token_owner(cu_num_tokens_ptr, batch)
    keep = offset < MAX_NUM_TOKENS
    values = torch.where(input_ptr == replace_from, replace_to, input_ptr)
    targets = keep.nonzero().squeeze(1)
    output_ptr[targets] = values[owner[targets]].to(output_ptr.dtype)


def sample_recovered_tokens(
    output_token_ids_ptr,
    cu_num_draft_tokens_ptr,
    draft_token_ids_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    inv_q_ptr,
    vocab_size,
    BLOCK_SIZE,
    NO_DRAFT_PROBS,
    USE_FP64_GUMBEL,
):
    batch = cu_num_draft_tokens_ptr.shape[0]
    if batch == 0:
        return
    owner, _ = _token_owner(cu_num_draft_tokens_ptr, batch)
    total = owner.shape[0]
    target = target_probs_ptr[:total]
    if NO_DRAFT_PROBS:
        draft = draft_token_ids_ptr[:total].to(torch.int64)
        vocab = torch.arange(target.shape[1], device=target.device)
        prob = target.masked_fill(vocab[None, :] == draft[:, None], 0.0)
    else:
        prob = (target - draft_probs_ptr[:total]).clamp_(min=0.0)
    # prob * (1 / q) with q ~ Exp(1): an argmax that samples from prob (normalisation not needed);
    # float64 noise promotes the product, as USE_FP64_GUMBEL does in the kernel.
    score = prob * inv_q_ptr[owner]
    recovered = score.argmax(dim=-1).clamp_(max=target.shape[1] - 1)
    output_token_ids_ptr[:total] = recovered.to(output_token_ids_ptr.dtype)


_OVERRIDES = {
    f"{_MODULE}.rejection_greedy_sample_kernel": rejection_greedy_sample,
    f"{_MODULE}.rejection_random_sample_kernel": rejection_random_sample,
    f"{_MODULE}.expand_kernel": expand,
    f"{_MODULE}.sample_recovered_tokens_kernel": sample_recovered_tokens,
}


def register_rejection_kernels() -> None:
    """Route the rejection sampler's Triton kernels to the torch versions above (no-op when Triton
    runs). Idempotent: a kernel already routed to its torch version is not wrapped again."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    from vllm.triton_utils import dispatcher

    from vllm_metal.compat.triton_dispatch import register_kernels

    pending = {
        name: impl
        for name, impl in _OVERRIDES.items()
        if dispatcher._registry.get(name, (None, None))[1] is not impl
    }
    if pending:
        register_kernels(pending)
