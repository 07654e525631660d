"""Verification of drafts: on the device where rows are greedy or sampled with a temperature,
top-k and top-p, with or without penalties, allowed tokens, bad words, a minimum length and top
logprobs (`verifies_on_device`, `device_verdicts`, `verified`), else with vLLM's own
`RejectionSampler`. (Under speculative decoding vLLM builds no min-p or logit-bias processor:
those parameters do nothing, here as there.)

A request verifying k drafts has k+1 logits rows, in request order: the rows of
`[last sampled, d1..dk]`, so row j scores draft j+1 and the last row gives the bonus token. The
sampler accepts drafts by vLLM's rules (greedy: while the draft is the argmax; random: with
probability min(1, p_target/p_draft), else a token from the residual distribution), which keeps
the output distribution of non-speculative sampling. Seeded sampled rows are then verified by
position (`seeded.py`; on the device's path, `seeded_by_position`, only their logits rows are
copied), which keeps their tokens those of decoding without drafts. Its Triton
kernels run as the torch implementations in `kernels.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import _SAMPLING_EPS
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.worker.gpu_input_batch import InputBatch

from vllm_metal.backends.mlx.runner import seeded
from vllm_metal.backends.mlx.runner.batch import PackedBatch, offsets, ranges
from vllm_metal.backends.mlx.runner.device_sampling import (
    Draw,
    keyed_tokens,
    logprob_values,
    sample_rows,
    samples_random_rows,
    step_logprobs,
    with_tokens,
)
from vllm_metal.backends.mlx.runner.forward import step_token_ids
from vllm_metal.backends.mlx.runner.logits_rules import (
    allowed,
    bad_words_masked,
    min_tokens_masked,
    penalized,
)
from vllm_metal.backends.mlx.runner.tensors import to_host, to_torch
from vllm_metal.ops.argmax import row_argmax

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.seeded import KeyedNoise


def _rows(num_draft: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each request's first logits row (`[S]`) and the rows that score its drafts, request by
    request (`[drafts]`): a request with k drafts has rows first .. first + k, the last its bonus."""
    first_row = offsets(num_draft + 1)
    return first_row, np.repeat(first_row, num_draft) + ranges(num_draft)


def _drafts(batch: InputBatch, num_draft: np.ndarray) -> np.ndarray:
    """The step's drafts as the scheduler sent them, request by request (`[drafts]`): -1
    placeholders stay -1 and are always rejected."""
    return np.fromiter(
        (t for i, n in enumerate(num_draft) for t in batch.spec_token_ids[i][:n]),
        dtype=np.int64,
        count=int(num_draft.sum()),
    )


def _row_drafts(num_draft: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """Each logits row's draft (`[S + drafts]`): the draft it scores, -1 on a bonus row (and
    where the scheduler's placeholder is)."""
    _, target = _rows(num_draft)
    draft = np.full(int(num_draft.sum()) + len(num_draft), -1, dtype=np.int64)
    draft[target] = drafts
    return draft


def row_outputs(
    outputs: list[list[int]], num_draft: np.ndarray, drafts: np.ndarray
) -> list[list[int]]:
    """Each logits row's output tokens as vLLM's samplers count them for penalties when they
    verify drafts: its request's outputs so far, then the drafts before the row (the bonus row
    counts them all)."""
    starts = offsets(num_draft)
    return [
        [*outputs[i], *drafts[starts[i] : starts[i] + j].tolist()]
        for i, n in enumerate(num_draft)
        for j in range(n + 1)
    ]


def spec_decode_metadata(packed: PackedBatch, batch: InputBatch) -> SpecDecodeMetadata:
    """vLLM's metadata for the step's logits rows (indices into `[S + drafts, V]`)."""
    num_draft = packed.num_draft_tokens.astype(np.int64)
    first_row, target_rows = _rows(num_draft)
    cu_sampled = (first_row + num_draft + 1).astype(np.int32)
    return SpecDecodeMetadata(
        draft_token_ids=torch.from_numpy(_drafts(batch, num_draft).astype(np.int32)),
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


def verifies_on_device(states: RequestStates) -> bool:
    """Whether a step's drafts are verified on the device (`device_verdicts`): every row greedy,
    or sampled with nothing but a temperature, top-k and top-p (a seeded row's verdicts are
    then drawn by position on the host, `seeded_by_position`, unless one asks for a grammar or
    a thinking budget), and nothing the `RejectionSampler` would apply first but the rules
    `_rules` applies as it does (no thinking budget or custom processor); top logprobs may be
    asked for, not logprobs of named tokens (vLLM's verification ignores those); prompt
    logprobs are gathered apart from their own logits rows. A grammar, known only when the step
    is sampled, sends it back."""
    metadata = states.input_batch.sampling_metadata
    holder = getattr(metadata, "thinking_budget_state_holder", None)
    sampled_ok = metadata.all_greedy or (
        samples_random_rows(metadata)
        and (not metadata.generators or seeded.host_rows(states) is not None)
    )
    return (
        sampled_ok
        and not metadata.logprob_token_ids
        and not (holder is not None and holder.has_tracked_requests())
        and not any(_unapplied(p) for p in metadata.logitsprocs.non_argmax_invariant)
    )


def _unapplied(processor) -> bool:
    """Whether a processor that may move the argmax is one `_rules` does not apply. Under
    speculative decoding vLLM 0.32 builds the minimum-length one only (`build_logitsprocs`: no
    logit bias, no min-p, custom ones refused), so this holds only if a later vLLM adds one."""
    return not isinstance(processor, MinTokensLogitsProcessor)


def _rules(
    logits: mx.array,
    metadata: SamplingMetadata,
    num_draft: np.ndarray,
    drafts: np.ndarray,
) -> mx.array:
    """`logits` (`[S + drafts, V]`) after the rules vLLM 0.32 applies to verification rows:
    the presence, frequency and repetition penalties, each row counting its request's outputs
    and the drafts before it (`row_outputs`); the allowed tokens; bad words, each row's words
    matched against those same tokens; and a minimum length, whose stop tokens a row scoring
    a draft loses while its position is below the minimum and a bonus row while its request's
    outputs so far are (vLLM's `Sampler` with `predict_bonus_token` counts no drafts there)."""
    num_reqs = len(num_draft)
    owner = np.repeat(np.arange(num_reqs), num_draft + 1)
    bad_words = metadata.bad_words_token_ids
    if not metadata.no_penalties or bad_words:
        outputs = row_outputs(metadata.output_token_ids, num_draft, drafts)
    if not metadata.no_penalties:
        logits = penalized(logits, metadata, owner, outputs)
    if metadata.allowed_token_ids_mask is not None:
        logits = allowed(logits, metadata.allowed_token_ids_mask.numpy()[owner])
    if bad_words:
        words = {row: bad_words[i] for row, i in enumerate(owner.tolist()) if i in bad_words}
        logits = bad_words_masked(logits, words, outputs)
    for processor in metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks:
            logits = min_tokens_masked(logits, _min_tokens_rows(processor.min_toks, num_draft))
    return logits


def _min_tokens_rows(min_toks: dict, num_draft: np.ndarray) -> dict:
    """vLLM's `MinTokensLogitsProcessor.min_toks` (request -> (minimum, outputs, stop ids,
    structured)) keyed by the logits rows whose stop tokens it masks: a request's rows scoring
    drafts at positions below its minimum, and its bonus row."""
    first_row, _ = _rows(num_draft)
    rows = {}
    for i, entry in min_toks.items():
        if i >= len(num_draft):
            continue
        below = min(max(entry[0] - len(entry[1]), 0), int(num_draft[i]))
        for j in [*range(below), int(num_draft[i])]:
            rows[int(first_row[i]) + j] = entry
    return rows


def device_verdicts(
    logits: mx.array,
    packed: PackedBatch,
    batch: InputBatch,
    key: mx.array,
    keyed: KeyedNoise | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Per logits row (`[S + drafts]`, each request's rows of `[last sampled, d1..dk]`): the
    token it gives and whether it accepts the draft it scores, by vLLM's rejection rules with
    no draft probabilities (a draft is a point mass), and the `[S + drafts, V]` logits its token
    was taken from (what vLLM's processed logprobs read). Each request's rules come first
    (`_rules`: penalties, allowed tokens, bad words, a minimum length). A greedy row
    accepts while its argmax is the draft and gives its argmax. A sampled row's probabilities
    `p` are the softmax of its logits after its request's temperature, top-k and top-p; it
    accepts draft `d` with probability `p[d]` (giving `d`), else gives a token drawn from `p`
    without `d`; the last row of a request (its bonus) draws from `p`. Placeholders (-1) are
    never accepted. The rows of `keyed` (a seeded request's, `seeded.keyed_noise`) are drawn by
    position instead: each gives the token its position's noise picks from `p`, accepting its
    draft where that is the draft, so the request's tokens are those of decoding without
    drafts. Lazy."""
    num_draft = packed.num_draft_tokens.astype(np.int64)
    num_reqs = len(num_draft)
    owner = np.repeat(np.arange(num_reqs), num_draft + 1)
    drafts = _drafts(batch, num_draft)
    draft = _row_drafts(num_draft, drafts)
    metadata = batch.sampling_metadata
    logits = _rules(logits, metadata, num_draft, drafts)
    argmax = row_argmax(logits)
    if packed.shift is None:
        row_draft = mx.array(draft.astype(np.int32))
    else:  # the drafts were carried in on the device (`ahead.CarriedDrafts`)
        row_draft = _carried_row_drafts(packed)
    greedy_accept = argmax == row_draft
    if metadata.all_greedy:
        return argmax, greedy_accept, logits
    is_target = np.zeros(len(draft), dtype=bool)
    is_target[_rows(num_draft)[1]] = True
    temperature = batch.temperature_cpu[:num_reqs][owner]
    top_k = None if batch.no_top_k else batch.top_k_cpu[:num_reqs][owner]
    top_p = None if batch.no_top_p else batch.top_p_cpu[:num_reqs][owner]
    draw_key, accept_key, residual_key = mx.random.split(key, 3)
    drawn, processed = sample_rows(logits, temperature, top_k, top_p, draw_key)
    real = row_draft >= 0
    d = mx.maximum(row_draft, 0)[:, None]
    p_draft = mx.take_along_axis(mx.softmax(processed, axis=-1, precise=True), d, axis=-1)[:, 0]
    accept = real & (mx.random.uniform(shape=p_draft.shape, key=accept_key) < p_draft)
    is_draft = (mx.arange(processed.shape[-1])[None, :] == d) & real[:, None]
    residual = mx.where(is_draft, -mx.inf, processed)
    noise = mx.random.gumbel(shape=residual.shape, key=residual_key)
    recovered = row_argmax(residual + noise)
    sampled = mx.where(mx.array(is_target), mx.where(accept, d[:, 0], recovered), drawn)
    greedy = mx.array(temperature < _SAMPLING_EPS)
    tokens = mx.where(greedy, argmax, sampled)
    accepts = mx.where(greedy, greedy_accept, accept)
    if keyed is not None and keyed.exponentials is not None:
        rows, by_position = keyed_tokens(processed, keyed)
        tokens[rows] = by_position.astype(tokens.dtype)
        accepts[rows] = by_position == row_draft[rows]
    return tokens, accepts, processed


def _carried_row_drafts(packed: PackedBatch) -> mx.array:
    """Each logits row's draft where a step's drafts are on the device only, in its token ids
    (a step of decode rows, one logits row per token): the token after the row in its request,
    -1 on a request's last row (its bonus)."""
    ids = step_token_ids(packed)
    last = np.zeros(packed.num_tokens, dtype=bool)
    last[packed.cu_seqlens_q[1:] - 1] = True
    after = np.minimum(np.arange(1, packed.num_tokens + 1), packed.num_tokens - 1)
    return mx.where(mx.array(last), -1, ids[mx.array(after.astype(np.int32))])


def verdict_logprobs(
    logits: mx.array,
    tokens: mx.array,
    processed: mx.array,
    metadata: SamplingMetadata,
    logprobs_mode: str,
) -> tuple[tuple[mx.array, mx.array, mx.array] | None, mx.array | None]:
    """Every row's logprobs (`device_sampling.step_logprobs`) of the token its verdict gives
    (`device_verdicts`: `tokens`, and `processed`, the logits those were taken from), as vLLM's
    `RejectionSampler` takes them from the target's raw or processed logits, and the values
    they were read from (`logprob_values`); (None, None) when the step asks for none.
    `verified` keeps the rows of the tokens output."""
    if metadata.max_num_logprobs is None:
        return None, None
    values = logprob_values(logits, Draw(tokens, processed), logprobs_mode)
    return step_logprobs(values, tokens, metadata), values


def verdict_outputs(
    verdicts: tuple[mx.array, mx.array],
    logprobs: tuple[mx.array, mx.array, mx.array] | None,
    values: mx.array | None,
    logits: mx.array,
    packed: PackedBatch,
    states: RequestStates,
    sampler: Sampler,
    by_position: bool = False,
) -> tuple[list[list[int]], LogprobsLists | None]:
    """Each request's output tokens and their logprobs from the device's verdicts (`tokens`,
    `accepts` of `device_verdicts`; `logprobs` and `values` of `verdict_logprobs`), its seeded
    requests' drawn by position (`seeded_by_position`) with their logprobs of those tokens,
    unless the device drew them so (`by_position`)."""
    tokens, accepts = (np.array(to_host(a)) for a in verdicts)
    if states.input_batch.generators and not by_position:
        drawn = seeded_by_position(logits, packed, states, sampler, tokens, accepts)
        if logprobs is not None and drawn:
            logprobs = with_tokens(logprobs, values, drawn)
    host = None if logprobs is None else tuple(to_host(a) for a in logprobs)
    return verified(tokens, accepts, packed, states.vocab_size, host)


def seeded_by_position(
    logits: mx.array,
    packed: PackedBatch,
    states: RequestStates,
    sampler: Sampler,
    tokens: np.ndarray,
    accepts: np.ndarray,
) -> dict[int, int]:
    """The verdicts (`tokens`, `accepts`: host copies, changed in place) of the step's seeded
    requests drawn by position instead (`seeded.py`): each of their logits rows, after its
    rules (`_rules`) and copied to the host, gives the token the request samples at its
    position (`seeded.draws_by_position`) and accepts its draft where that token is the draft,
    so their tokens are those of decoding without drafts. The rows drawn: row -> token."""
    batch = states.input_batch
    num_draft = packed.num_draft_tokens.astype(np.int64)
    requests = [i for i in sorted(batch.generators) if i < len(num_draft) and not packed.discard[i]]
    if not requests:
        return {}
    first_row, _ = _rows(num_draft)
    drafts = _drafts(batch, num_draft)
    rows, owners, positions = seeded.verification_rows(
        requests, first_row, num_draft, batch.num_tokens_no_spec
    )
    ruled = _rules(logits, batch.sampling_metadata, num_draft, drafts)[mx.array(rows)]
    drawn = seeded.draws_by_position(sampler, to_torch(ruled), owners, positions, states)
    draft = _row_drafts(num_draft, drafts)
    tokens[rows] = drawn
    accepts[rows] = np.array(drawn) == draft[rows]
    return dict(zip(rows, drawn))


def verified(
    tokens: np.ndarray,
    accepts: np.ndarray,
    packed: PackedBatch,
    vocab_size: int,
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[list[list[int]], LogprobsLists | None]:
    """Each request's output tokens from its rows' verdicts (`device_verdicts`): the tokens of
    its leading rows that accept their drafts, then the next row's (a rejected draft's
    replacement, or the bonus token when every draft was accepted); `[]` for a row mid-prefill.
    Tokens past the vocabulary are dropped, as vLLM's `parse_output` drops them. With the rows'
    logprobs (`device_sampling.step_logprobs` of the verdicts' tokens), also those of the
    tokens kept, request by request, as vLLM's `parse_output` keeps them (a row mid-prefill's
    too, though its token is not output)."""
    num_draft = packed.num_draft_tokens.astype(np.int64)
    num_reqs = len(num_draft)
    first_row, target = _rows(num_draft)
    matched = np.zeros((num_reqs, int(num_draft.max(initial=0))), dtype=bool)
    matched[np.repeat(np.arange(num_reqs), num_draft), ranges(num_draft)] = accepts[target]
    accepted = np.cumprod(matched, axis=1).sum(axis=1)  # leading accepts
    out, kept = [], []
    for i in range(num_reqs):
        rows = np.arange(first_row[i], first_row[i] + accepted[i] + 1)
        rows = rows[tokens[rows] < vocab_size]
        kept.append(rows)
        out.append([] if packed.discard[i] else tokens[rows].tolist())
    if logprobs is None:
        return out, None
    rows = np.concatenate(kept)
    ids, values, ranks = (a[rows] for a in logprobs)
    cu = np.cumsum([0] + [len(r) for r in kept]).tolist()
    return out, LogprobsLists(ids, values, ranks.astype(np.int64), cu)
