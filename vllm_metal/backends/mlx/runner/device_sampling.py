"""Tokens sampled on the device, queued with the step's logits so the logits never reach the host.

Each request's rules over its logits (allowed token ids, bad words, min tokens, a logit bias,
presence, frequency and repetition penalties) are applied first, on the device, in the order of
vLLM's `Sampler` (`logits_rules.py`). A step whose rows all sample greedily takes each row's
argmax. A step whose rows sample with nothing else but a temperature, min-p, top-k and top-p
(greedy rows may sit beside them) takes a sample drawn on the device with vLLM's `Sampler`
semantics: the logits divided by the row's temperature; min-p drops each token whose
probability (at that temperature) is below min-p times the row's largest; top-k keeps the k
largest; top-p keeps, in descending order, each token whose preceding mass (after top-k) is
below p, so the smallest set holding at least p survives, as vLLM's `apply_top_k_top_p` does;
then one draw from the softmax of what is kept (Gumbel-max). Greedy rows (temperature below
vLLM's epsilon) keep their argmax. Logprobs (top-k, or of named tokens) are computed with the
tokens in each of vLLM's modes: of the raw logits, or of the processed ones the tokens were drawn
from (`Draw.processed`, `logprob_values`, `step_logprobs`).

A seeded row is drawn with its own noise, made on the host and keyed to the position it samples
(`seeded.keyed_noise`): the argmax of its probabilities divided by those exponential draws, as
vLLM's `random_sample` picks it. Whether the step may use these tokens is decided when it is
sampled (`sample.host_route`): a grammar's bitmask is applied on the device and the tokens drawn
again (`grammar_masked`); a step with what the device does not apply (a custom logits
processor, a thinking budget) goes to vLLM's `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.sampler import _SAMPLING_EPS

from vllm_metal.backends.mlx.runner.logits_rules import Unrecorded, apply_rules
from vllm_metal.ops.argmax import row_argmax

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_metal.backends.mlx.runner.seeded import KeyedNoise


def samples_random_rows(metadata: SamplingMetadata) -> bool:
    """Whether the step's random rows can be sampled on the device: the only processor acting
    on them before top-k/top-p is vLLM's min-p (what else reads the logits is checked when the
    step is sampled; a seeded row's draw is replaced there by the host's, `seeded.py`)."""
    if metadata.all_greedy:
        return False
    return all(isinstance(p, MinPLogitsProcessor) for p in metadata.logitsprocs.argmax_invariant)


def min_p_of(metadata: SamplingMetadata, n: int) -> np.ndarray | None:
    """Each row's min-p (0: none) from vLLM's min-p processor, or None when no row has one."""
    for p in metadata.logitsprocs.argmax_invariant:
        if isinstance(p, MinPLogitsProcessor) and p.min_p_count:
            return p.min_p_cpu[:n].astype(np.float32)
    return None


def logprob_values(logits: mx.array, draw: Draw, logprobs_mode: str) -> mx.array:
    """`[rows, V]` float32: what vLLM's `Sampler` takes a step's logprobs from in `logprobs_mode`:
    the raw logits (before any rule, penalty or temperature) or the processed ones (`Draw`),
    as they are (`*_logits`) or log-softmaxed (`*_logprobs`)."""
    source = draw.processed if logprobs_mode.startswith("processed") else logits
    if logprobs_mode.endswith("logprobs"):
        return source - mx.logsumexp(source, axis=-1, keepdims=True)
    return source


def step_logprobs(
    values: mx.array, tokens: mx.array, metadata: SamplingMetadata
) -> tuple[mx.array, mx.array, mx.array] | None:
    """The step's logprobs as vLLM's `Sampler` returns them, from `values` (`logprob_values`):
    `[rows, 1 + k]` token ids (the sampled token, then the row's k most likely tokens, most
    likely first), their values, and `[rows]` ranks of the sampled tokens (how many values are
    at least the sampled one's), k being the batch's largest request (the vocabulary size for
    `logprobs=-1`). Where a row names tokens (`logprob_token_ids`), every row's ids are instead
    the sampled token then the tokens it names (padding: token 0 at -inf), as vLLM prefers them.
    None when the step asks for no logprobs."""
    k, named = metadata.max_num_logprobs, metadata.logprob_token_ids
    if k is None and not named:
        return None
    sampled = tokens.astype(mx.int32)[:, None]
    chosen, ranks = _of_sampled(values, sampled)
    if named:
        ids, valid = _named(named, values.shape[0])
        ids = mx.concatenate([sampled, mx.array(ids)], axis=-1)
        named_values = mx.take_along_axis(values, ids, axis=-1)
        return ids, mx.where(mx.array(valid), named_values, -mx.inf), ranks
    ids, picked = [sampled], [chosen]
    k = min(k, values.shape[-1])
    if k > 0:
        top = mx.argpartition(-values, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(values, top, axis=-1)
        order = mx.argsort(-top_values, axis=-1)
        ids.append(mx.take_along_axis(top, order, axis=-1).astype(mx.int32))
        picked.append(mx.take_along_axis(top_values, order, axis=-1))
    return mx.concatenate(ids, axis=-1), mx.concatenate(picked, axis=-1), ranks


def _of_sampled(values: mx.array, sampled: mx.array) -> tuple[mx.array, mx.array]:
    """`[rows, 1]` values of the sampled tokens (`[rows, 1]`) and their `[rows]` ranks."""
    chosen = mx.take_along_axis(values, sampled, axis=-1)
    return chosen, mx.sum(values >= chosen, axis=-1)


def with_tokens(
    logprobs: tuple[mx.array, mx.array, mx.array], values: mx.array, drawn: dict[int, int]
) -> tuple[mx.array, mx.array, mx.array]:
    """`step_logprobs`' arrays with the tokens of rows drawn elsewhere (`drawn`: row -> token,
    seeded rows drawn on the host) as those rows' sampled tokens: their ids, values and ranks
    (the rest of each row does not depend on the token)."""
    ids, picked, ranks = logprobs
    rows = mx.array(list(drawn), dtype=mx.int32)
    sampled = mx.array(list(drawn.values()), dtype=mx.int32)[:, None]
    chosen, their_ranks = _of_sampled(values[rows], sampled)
    ids[rows, :1] = sampled
    picked[rows, :1] = chosen
    ranks[rows] = their_ranks.astype(ranks.dtype)
    return ids, picked, ranks


def _named(named: dict[int, list[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """`[rows, m]` int32 ids each row names (m the longest list; 0 past a row's own) and
    `[rows, 1 + m]` bool: which of the sampled token and those ids count."""
    width = max(len(t) for t in named.values())
    ids = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, 1 + width), bool)
    valid[:, 0] = True
    for row, tokens in named.items():
        if row < rows:
            ids[row, : len(tokens)] = tokens
            valid[row, 1 : 1 + len(tokens)] = True
    return ids, valid


def grammar_masked(logits: mx.array, rows: np.ndarray, bitmask: np.ndarray) -> mx.array:
    """`logits` (`[n, V]`) with rows `rows` masked by their grammars' bitmasks (`[len(rows),
    words]` int32, bit j of word i allowing token 32 i + j), as vLLM's `apply_grammar_bitmask`
    masks them through xgrammar: a token not allowed gets -inf; columns past the bitmask's
    width, and the other rows, are left as they are."""
    n, vocab = logits.shape
    width = min(vocab, bitmask.shape[1] * 32)
    words = mx.array(np.ascontiguousarray(bitmask).view(np.uint32))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :width] > 0
    if width < vocab:
        allowed = mx.concatenate([allowed, mx.ones((len(rows), vocab - width), mx.bool_)], 1)
    allowed = mx.concatenate([allowed, mx.ones((1, vocab), mx.bool_)])  # the unmasked row
    pick = np.full(n, len(rows), dtype=np.int32)
    pick[rows] = np.arange(len(rows), dtype=np.int32)
    return mx.where(allowed[mx.array(pick)], logits, -mx.inf)


@dataclass
class Draw:
    """A step's tokens drawn on the device, and the logits they were drawn from after every
    rule, the temperature, min-p, top-k and top-p (the tokens those drop at -inf): what vLLM's
    processed logprobs modes read (greedy rows' temperature counts as 1)."""

    tokens: mx.array  # [rows]
    processed: mx.array  # [rows, V] float32


class DeviceSampler:
    """Draws the device tokens of a step; its random keys come from the engine's seed."""

    def __init__(self, seed: int | None):
        self._rng = np.random.default_rng(seed)

    def next_key(self) -> mx.array:
        """A fresh random key of the engine's stream."""
        return mx.random.key(int(self._rng.integers(2**63)))

    def outputs(
        self,
        logits: mx.array,
        batch: InputBatch,
        logprobs_mode: str,
        unrecorded: Unrecorded | None = None,
        keyed: KeyedNoise | None = None,
    ) -> tuple[mx.array | None, tuple[mx.array, mx.array, mx.array] | None, mx.array | None]:
        """A step's device tokens, their logprobs where the step asks for them, and the values
        those were taken from (`logprob_values`); Nones where the device draws nothing.
        `unrecorded`: the rows' outputs still on the device (`logits_rules.penalized`);
        `keyed`: the seeded rows' noise (`draw`)."""
        draw = self.draw(logits, batch, unrecorded, keyed) if logits.size else None
        if draw is None:
            return None, None, None
        values = logprob_values(logits, draw, logprobs_mode)
        logprobs = step_logprobs(values, draw.tokens, batch.sampling_metadata)
        return draw.tokens, logprobs, None if logprobs is None else values

    def draw(
        self,
        logits: mx.array,
        batch: InputBatch,
        unrecorded: Unrecorded | None = None,
        keyed: KeyedNoise | None = None,
    ) -> Draw | None:
        """The tokens for `logits` (`[rows, V]` float32, one row per request of `batch`) after
        the rows' rules (`logits_rules.apply_rules`): every row's argmax when all are greedy, a
        sample of the random rows beside the greedy rows' argmax where `samples_random_rows`
        allows, the seeded rows of `keyed` drawn with their own noise; else None."""
        n, metadata = batch.num_reqs, batch.sampling_metadata
        if logits.shape[0] != n or n == 0:
            return None
        logits = apply_rules(logits, metadata, unrecorded)
        if metadata.all_greedy:
            return Draw(row_argmax(logits), logits)
        if not samples_random_rows(metadata):
            return None
        key = self.next_key()
        temperature = batch.temperature_cpu[:n]
        top_k = None if batch.no_top_k else batch.top_k_cpu[:n]
        top_p = None if batch.no_top_p else batch.top_p_cpu[:n]
        drawn, processed = sample_rows(
            logits, temperature, top_k, top_p, key, min_p_of(metadata, n)
        )
        greedy_rows = temperature < _SAMPLING_EPS
        if greedy_rows.any():
            drawn = mx.where(mx.array(greedy_rows), row_argmax(logits), drawn)
        if keyed is not None and keyed.exponentials is not None:
            drawn = with_own_noise(drawn, processed, keyed)
        return Draw(drawn, processed)


def with_own_noise(drawn: mx.array, processed: mx.array, keyed: KeyedNoise) -> mx.array:
    """`drawn` with the tokens of the rows of `keyed` picked as vLLM's `random_sample` picks
    them: the argmax of the probabilities (the softmax of `processed`, where what the row's
    rules, min-p, top-k and top-p drop is -inf) divided by the row's exponential draws."""
    rows, tokens = keyed_tokens(processed, keyed)
    drawn[rows] = tokens.astype(drawn.dtype)
    return drawn


def keyed_tokens(processed: mx.array, keyed: KeyedNoise) -> tuple[mx.array, mx.array]:
    """The rows of `keyed` as a device index, and their tokens (`with_own_noise`), `[m]` each."""
    rows = mx.array(keyed.rows.astype(np.int32))
    probs = mx.softmax(processed[rows], axis=-1, precise=True)
    return rows, row_argmax(probs / keyed.exponentials)


def sample_rows(
    logits: mx.array,
    temperature: np.ndarray,
    top_k: np.ndarray | None,
    top_p: np.ndarray | None,
    key: mx.array,
    min_p: np.ndarray | None = None,
) -> tuple[mx.array, mx.array]:
    """One draw per row from softmax(logits / temperature) after min-p, top-k and top-p (vLLM's
    semantics, above); `min_p` of 0, `top_k` of the vocabulary size or more and `top_p` of 1
    keep every token. Rows with a temperature below epsilon are drawn at temperature 1 (the
    caller keeps their argmax). Also returns the logits drawn from (`Draw.processed`)."""
    t = np.where(temperature < _SAMPLING_EPS, 1.0, temperature).astype(np.float32)
    scaled = logits / mx.array(t)[:, None]
    if min_p is not None:
        probs = mx.softmax(scaled, axis=-1, precise=True)
        floor = mx.max(probs, axis=-1, keepdims=True) * mx.array(min_p)[:, None]
        scaled = mx.where(probs < floor, -mx.inf, scaled)
    noise = mx.random.gumbel(shape=scaled.shape, key=key)
    if top_k is None and top_p is None:
        return row_argmax(scaled + noise), scaled
    vocab = scaled.shape[-1]
    order = mx.argsort(-scaled, axis=-1)  # descending
    ranked = mx.take_along_axis(scaled, order, axis=-1)
    keep = mx.ones(ranked.shape, dtype=mx.bool_)
    if top_k is not None:
        k = mx.array(np.minimum(top_k, vocab).astype(np.int32))
        keep = mx.arange(vocab)[None, :] < k[:, None]
        ranked = mx.where(keep, ranked, -mx.inf)
    if top_p is not None:
        probs = mx.softmax(ranked, axis=-1, precise=True)
        before = mx.cumsum(probs, axis=-1) - probs
        p = mx.array(top_p.astype(np.float32))
        keep = keep & ((before < p[:, None]) | (mx.arange(vocab)[None, :] == 0))
    choice = row_argmax(mx.where(keep, ranked, -mx.inf) + noise)
    kept = mx.put_along_axis(mx.zeros(keep.shape, mx.bool_), order, keep, axis=-1)
    return mx.take_along_axis(order, choice[:, None], axis=-1)[:, 0], mx.where(
        kept, scaled, -mx.inf
    )
