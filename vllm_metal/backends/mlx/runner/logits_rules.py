"""vLLM's per-request rules over a step's logits, applied on the device before sampling, in the
order its `Sampler.apply_logits_processors` applies them: the allowed token ids, then bad words,
then the built-in processors that may move the argmax in their registered order (min tokens,
then the logit bias), then the presence, frequency and repetition penalties. Temperature, min-p
and top-k/top-p follow (`device_sampling.sample_rows`).

What each rule needs is read on the host and is small: which (row, token) pairs to ban, bias or
count. The logits stay on the device. A processor other than vLLM's built-ins is not applied
here: a step with one goes to vLLM's `Sampler` on the host (`sample.host_route`). The rules
over the outputs so far (penalties, min tokens, bad words) also count those the host does not
hold yet, a pending step's tokens carried into this one on the device
(`step.unrecorded_outputs`), so a step with them need not wait for the one before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata


def apply_rules(
    logits: mx.array, metadata: SamplingMetadata, unrecorded: Unrecorded | None = None
) -> mx.array:
    """`logits` (`[rows, V]` float32, one row per request) after every built-in rule its rows
    ask for, as vLLM's `Sampler` applies them before temperature; `unrecorded`: outputs the
    host's token lists lack yet (`bad_words_masked`, `still_short`, `penalized`)."""
    rows = logits.shape[0]
    if metadata.allowed_token_ids_mask is not None:
        logits = allowed(logits, metadata.allowed_token_ids_mask[:rows].numpy())
    if metadata.bad_words_token_ids:
        logits = bad_words_masked(
            logits, metadata.bad_words_token_ids, metadata.output_token_ids, unrecorded
        )
    for processor in metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks:
            logits = min_tokens_masked(logits, still_short(processor.min_toks, unrecorded))
        elif isinstance(processor, LogitBiasLogitsProcessor) and processor.biases:
            logits = biased(logits, processor.biases)
    if not metadata.no_penalties:
        logits = penalized(logits, metadata, unrecorded=unrecorded)
    return logits


def allowed(logits: mx.array, banned: np.ndarray) -> mx.array:
    """`logits` with the tokens of vLLM's `allowed_token_ids_mask` (`[rows, vocab]` bool, True:
    not allowed) at -inf; columns past the mask's width are left as they are."""
    width = min(banned.shape[1], logits.shape[1])
    ban = mx.array(banned[:, :width])
    if width < logits.shape[1]:
        ban = mx.concatenate([ban, mx.zeros((ban.shape[0], logits.shape[1] - width), mx.bool_)], 1)
    return mx.where(ban, -mx.inf, logits)


def bad_word_bans(
    bad_words: dict[int, list[list[int]]],
    outputs: list[list[int]],
    rows: int,
    last: Mapping[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The (rows, tokens) vLLM's `apply_bad_words` sets to -inf: a bad word's last token, for a
    row whose output so far ends with the word's other tokens (a one-token word: always). A row
    in `last` has one more output the host's list lacks, unrecorded token `last[row]`: a word's
    ban then holds where that token is the word's second-to-last and the host's list ends with
    the tokens before it. Returns (rows, tokens, on, need): pair i is banned outright where
    on[i] < 0, else where unrecorded token on[i] is need[i]."""
    entries: list[tuple[int, int, int, int]] = []
    for row, words in bad_words.items():
        if row >= rows:
            continue
        past, on = outputs[row], -1 if last is None else last.get(row, -1)
        for word in words:
            meets = on >= 0 and len(word) > 1  # the unrecorded token ends the word's prefix
            held = len(word) - 1 - meets  # the prefix tokens the host's list must end with
            if held > len(past):
                continue
            if held == 0 or list(past[len(past) - held :]) == list(word[:held]):
                entries.append((row, word[-1], on, word[-2]) if meets else (row, word[-1], -1, 0))
    if not entries:
        return (np.zeros(0, np.int64),) * 4
    return tuple(np.array(c, np.int64) for c in zip(*entries))  # type: ignore[return-value]


def bad_words_masked(
    logits: mx.array,
    bad_words: dict[int, list[list[int]]],
    outputs: list[list[int]],
    unrecorded: Unrecorded | None = None,
) -> mx.array:
    """`logits` with each row's bad words (`bad_word_bans`) at -inf, matched against its
    `outputs` so far and the `unrecorded` token of a row that has one (compared on the
    device)."""
    last = None if unrecorded is None else {int(r): i for i, r in enumerate(unrecorded[0])}
    rows, tokens, on, need = bad_word_bans(bad_words, outputs, logits.shape[0], last)
    hit = None
    if (on >= 0).any():
        assert unrecorded is not None
        carried = unrecorded[1][mx.array(np.maximum(on, 0).astype(np.int32))]
        hit = mx.array(on < 0) | (carried == mx.array(need.astype(np.int32)))
    return mx.where(_pairs(logits.shape, rows, tokens, hit), -mx.inf, logits)


def still_short(
    min_toks: dict[int, tuple[int, list[int], set[int], bool]], unrecorded: Unrecorded | None
) -> dict[int, tuple[int, list[int], set[int], bool]]:
    """vLLM's `MinTokensLogitsProcessor.min_toks` less the rows whose outputs reach their
    minimum: the processor counted the host's lists when the batch was last updated, before a
    step carried into the next one was recorded; those lists now, and the outputs still on the
    device (`unrecorded`), count here."""
    extra = np.zeros(max(min_toks, default=0) + 1, np.int64)
    if unrecorded is not None:
        rows = unrecorded[0][unrecorded[0] < len(extra)]
        np.add.at(extra, rows, 1)
    return {row: entry for row, entry in min_toks.items() if len(entry[1]) + extra[row] < entry[0]}


def min_tokens_masked(
    logits: mx.array, min_toks: dict[int, tuple[int, list[int], set[int], bool]]
) -> mx.array:
    """`logits` with each stop token of a row below its minimum length at -inf (vLLM's
    `MinTokensLogitsProcessor.min_toks`: row -> (minimum, outputs, stop ids, structured)); a
    structured-output row that the masking leaves all -inf (its grammar allows only stop tokens)
    gets its finite stop logits back, as vLLM's processor restores them."""
    entries = [(row, stop) for row, (_, _, stops, _) in min_toks.items() for stop in stops]
    entries = [(r, t) for r, t in entries if r < logits.shape[0]]
    if not entries:
        return logits
    rows, tokens = (np.array(c, np.int64) for c in zip(*entries))
    ban = _pairs(logits.shape, rows, tokens)
    out = mx.where(ban, -mx.inf, logits)
    structured = np.zeros(logits.shape[0], bool)
    structured[[r for r, entry in min_toks.items() if entry[3] and r < len(structured)]] = True
    if not structured.any():
        return out
    dead = mx.all(out == -mx.inf, axis=-1, keepdims=True) & mx.array(structured)[:, None]
    return mx.where(ban & dead & mx.isfinite(logits), logits, out)


def biased(logits: mx.array, biases: dict[int, dict[int, float]]) -> mx.array:
    """`logits` plus each row's logit bias (vLLM's `LogitBiasLogitsProcessor.biases`: row ->
    token -> bias)."""
    rows, vocab = logits.shape
    entries = [(r, t, b) for r, bias in biases.items() if r < rows for t, b in bias.items()]
    if not entries:
        return logits
    row, token, bias = zip(*entries)
    flat = np.array(row, np.int64) * vocab + np.array(token, np.int64)
    add = mx.zeros((rows * vocab,), mx.float32).at[mx.array(flat)].add(mx.array(bias, mx.float32))
    return logits + add.reshape(rows, vocab)


def _pairs(
    shape: tuple[int, int], rows: np.ndarray, tokens: np.ndarray, where: mx.array | None = None
) -> mx.array:
    """`[rows, V]` bool, True at the pairs (rows[i], tokens[i]) (where `where[i]`, if given)."""
    n, vocab = shape
    flat = mx.zeros((n * vocab,), mx.float32)
    if rows.size:  # a float scatter-add, as the penalties' counts (`_bin_counts`)
        weight = 1.0 if where is None else where.astype(mx.float32)
        flat = flat.at[mx.array(rows * vocab + tokens)].add(weight)
    return flat.reshape(n, vocab) > 0


# (rows, tokens): outputs of those rows (numpy) that are tokens still on the device (MLX, [n]).
Unrecorded = tuple[np.ndarray, Any]


def penalized(
    logits: mx.array,
    metadata: SamplingMetadata,
    owners: np.ndarray | None = None,
    outputs: list[list[int]] | None = None,
    unrecorded: Unrecorded | None = None,
) -> mx.array:
    """`logits` (`[rows, V]` float32) after vLLM's presence, frequency and repetition penalties
    (`apply_all_penalties`): a token seen in the row's prompt or output has its logit divided by
    the repetition penalty where positive, multiplied where not; then each output occurrence
    takes off the frequency penalty and any occurrence the presence penalty. Row i is request i
    with its outputs so far, unless `owners` names each row's request and `outputs` each row's
    output tokens (rows verifying drafts count the drafts before them), and `unrecorded` adds
    outputs the lists lack yet. The counts are scattered on the device from the host's token
    lists; ids outside the vocabulary (placeholders, padding) count for nothing."""
    rows, vocab = logits.shape
    if owners is None:
        owners, outputs = np.arange(rows), metadata.output_token_ids[:rows]
    lengths = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=rows)
    counts = _bin_counts(
        np.repeat(np.arange(rows), lengths),
        np.fromiter(itertools.chain.from_iterable(outputs), np.int64, int(lengths.sum())),
        rows,
        vocab,
    )
    if unrecorded is not None:
        their_rows, tokens = unrecorded
        flat = mx.array(their_rows.astype(np.int64) * vocab) + tokens.astype(mx.int64)
        counts = counts.reshape(-1).at[flat].add(1.0).reshape(rows, vocab)
    seen = (counts > 0) | _PROMPT_MASKS.of(metadata.prompt_token_ids, owners, vocab)

    def per_row(values) -> mx.array:
        return mx.array(values.numpy()[owners])[:, None]

    penalty = mx.where(seen, per_row(metadata.repetition_penalties), 1.0)
    logits = logits * mx.where(logits > 0, 1.0 / penalty, penalty)
    frequency = per_row(metadata.frequency_penalties)
    presence = per_row(metadata.presence_penalties)
    return logits - frequency * counts - presence * (counts > 0)


def _bin_counts(row: np.ndarray, ids: np.ndarray, rows: int, vocab: int) -> mx.array:
    """`[rows, V]` float32: how often each token id occurs in each row (`ids[i]` in `row[i]`)."""
    keep = (ids >= 0) & (ids < vocab)
    flat = (row[keep] * vocab + ids[keep]).astype(np.int64)
    counts = mx.zeros((rows * vocab,), dtype=mx.float32)
    if flat.size:
        counts = counts.at[mx.array(flat)].add(1.0)
    return counts.reshape(rows, vocab)


class _LastPromptMask:
    """`[rows, V]` bool: the tokens of each row's prompt, from vLLM's `prompt_token_ids`
    (`[requests, longest prompt]`, padded with V) for the rows' `owners`. vLLM builds that
    tensor anew only when the batch changes, so the mask of the last one asked for is kept while
    the tensor stands: a step's long prompts are not scattered again on every step."""

    def __init__(self) -> None:
        self._tensor: Any = None
        self._rows: tuple[bytes, int] | None = None
        self._mask: mx.array | None = None

    def of(self, prompt_token_ids: Any, owners: np.ndarray, vocab: int) -> mx.array:
        rows_key = (owners.tobytes(), vocab)
        if self._tensor is prompt_token_ids and self._rows == rows_key:
            assert self._mask is not None
            return self._mask
        prompt = prompt_token_ids.numpy()[owners]
        rows = len(owners)
        in_prompt = _bin_counts(
            np.repeat(np.arange(rows), prompt.shape[1]), prompt.ravel(), rows, vocab
        )
        self._tensor, self._rows, self._mask = prompt_token_ids, rows_key, in_prompt > 0
        return self._mask


_PROMPT_MASKS = _LastPromptMask()
