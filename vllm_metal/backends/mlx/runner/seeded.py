"""Seeded requests draw their randomness by position.

vLLM gives a seeded request one generator and lets every sampling call advance it, so the tokens
depend on how many random numbers were drawn before: a request whose drafts were verified (the
rejection sampler draws for each draft it checks, and the back-off decides from measured times
whether a row drafts) would not repeat. Here, before a step samples, each seeded row's generator
is reseeded from its seed and the position of the token being sampled (`reseed`), so the noise
that picks a token is a function of (seed, position) alone: a seeded request's tokens depend on
its seed, its prompt and its logits, never on batching, chunking, preemption or speculation.

That also lets a seeded request draft: a point-mass draft (n-gram, a greedy draft model) is
accepted when it equals the token the target samples at its position with that position's noise
(`resample_drafts`), and the first mismatch is replaced by that sample. The output is exactly
the tokens decoding without speculation gives, and it has the target's distribution: a draft d
is kept with probability p(d), and a rejected position holds a sample of p conditioned on != d,
as in rejection sampling with a point-mass draft. Rows whose sampling reads more than their
logits (penalties, logit bias, min tokens or min-p, allowed or bad words, logprobs, a grammar)
do not draft (`drafts_by_position`).

A seeded row is drawn on the device (`keyed_noise`): its noise, the exponential draws vLLM's
`random_sample` takes from the row's generator keyed to that position, is made on the host,
where it depends on nothing the step computes (so a step built one ahead makes it too), and the
device picks the token vLLM's `Sampler` picks (probabilities after the row's rules,
temperature, min-p, top-k and top-p, divided by that noise; its argmax); on a step verifying
drafts on the device, each of a seeded request's rows so, a draft kept where it is that token
(`spec_decode.verify.device_verdicts`). The host's paths (a step whose rules only vLLM's
`Sampler` applies, drafts verified by vLLM's `RejectionSampler`) draw the same noise, so a
seeded request's tokens do not depend on which path its step took.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import torch
from vllm.sampling_params import SamplingParams, SamplingType
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata

from vllm_metal.backends.mlx.runner.batch import offsets

if TYPE_CHECKING:
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.request_state import RequestStates

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for the token at `position` of a request seeded with `seed`
    (splitmix64's finalizer over both, so neighbouring seeds and positions are unrelated)."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _seed(states: RequestStates, index: int) -> int:
    params = states.requests[states.input_batch.req_ids[index]].sampling_params
    assert params is not None and params.seed is not None, "a generator without a seed"
    return params.seed


def reseed(states: RequestStates) -> None:
    """Key each seeded row's generator to the position its next token takes (the row's token
    count without drafts), before the step's sampler draws."""
    batch = states.input_batch
    for i, generator in batch.generators.items():
        generator.manual_seed(position_seed(_seed(states, i), int(batch.num_tokens_no_spec[i])))


def drafts_by_position(params: SamplingParams | None) -> bool:
    """Whether a seeded sampled request's drafts can be verified by position: its token is a
    function of its logits, temperature, top-k and top-p alone."""
    if params is None or params.sampling_type != SamplingType.RANDOM_SEED:
        return False
    return (
        params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and params.min_p == 0.0
        and not params.min_tokens
        and not params.logit_bias
        and not params.allowed_token_ids
        and not params.bad_words
        and params.logprobs is None
        and params.structured_outputs is None
        and getattr(params, "thinking_token_budget", None) is None
    )


def resample_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    metadata: SpecDecodeMetadata,
    sampled: torch.Tensor,
    states: RequestStates,
) -> None:
    """Replace, in the rejection sampler's `sampled` (`[rows, max drafts + 1]`, -1 after the
    last kept token), the tokens of every seeded row that drafted: its drafts while each equals
    the token sampled at its position, then that position's sample."""
    batch = states.input_batch
    rows = [
        i
        for i, n in enumerate(metadata.num_draft_tokens)
        if n and i in batch.generators and drafts_by_position(_params(states, i))
    ]
    if not rows:
        return
    num_draft = np.asarray(metadata.num_draft_tokens)
    first = np.asarray(metadata.cu_num_sampled_tokens) - num_draft - 1
    drafts = metadata.draft_token_ids.tolist()
    draft_start = np.asarray(metadata.cu_num_draft_tokens) - num_draft
    logit_rows, owners, positions = verification_rows(
        rows, first, num_draft, batch.num_tokens_no_spec
    )
    tokens = draws_by_position(sampler, logits[logit_rows], owners, positions, states)
    at = 0
    for i in rows:
        k, own = int(num_draft[i]), drafts[int(draft_start[i]) : int(draft_start[i] + num_draft[i])]
        row = [-1] * sampled.shape[1]
        for j in range(k + 1):
            row[j] = tokens[at + j]
            if j == k or tokens[at + j] != own[j]:
                break
        sampled[i] = torch.tensor(row, dtype=sampled.dtype)
        at += k + 1


def verification_rows(
    requests: list[int], first_row: np.ndarray, num_draft: np.ndarray, start: np.ndarray
) -> tuple[list[int], list[int], list[int]]:
    """The logits rows of batch rows `requests` in a step verifying drafts (request i's rows
    first_row[i] .. first_row[i] + num_draft[i]), each row's request, and the position each
    samples (`start[i]`, the request's tokens so far, then one more a row)."""
    rows, owners, positions = [], [], []
    for i in requests:
        start_i = int(start[i])
        for j in range(int(num_draft[i]) + 1):
            rows.append(int(first_row[i]) + j)
            owners.append(i)
            positions.append(start_i + j)
    return rows, owners, positions


def draws_by_position(
    sampler: Sampler,
    logits: torch.Tensor,
    owners: list[int],
    positions: list[int],
    states: RequestStates,
) -> list[int]:
    """A token from each logits row (`[len(owners), V]`, after its request's rules), row r
    drawn with the temperature, top-k and top-p of batch row `owners[r]` and the generator of
    its seed keyed to `positions[r]`: the token decoding without drafts samples there."""
    generators = {}
    for r, (i, position) in enumerate(zip(owners, positions)):
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(position_seed(_seed(states, i), position))
        generators[r] = generator
    drawn = sampler(logits, _metadata(states, owners, generators)).sampled_token_ids
    return drawn.view(-1).tolist()


def host_rows(states: RequestStates) -> list[int] | None:
    """The seeded rows of a step verifying drafts on the device, when each of them can be drawn
    by position on the host (`spec_decode.verify.seeded_by_position`) from its logits row after
    the rules the device applies: it asks for no grammar or thinking budget. None when some
    seeded row asks for one of those."""
    rows = sorted(states.input_batch.generators)
    if all(_drawn_apart(_params(states, i)) for i in rows):
        return rows
    return None


def _drawn_apart(params: SamplingParams | None) -> bool:
    return (
        params is not None
        and params.sampling_type == SamplingType.RANDOM_SEED
        and params.structured_outputs is None
        and getattr(params, "thinking_token_budget", None) is None
    )


@dataclass
class KeyedNoise:
    """The noise of a step's seeded rows: each logits row's exponential draws for the position
    it samples, as vLLM's `random_sample` takes them from the row's generator."""

    rows: np.ndarray  # [m] logits rows drawn with their own noise
    exponentials: mx.array | None  # [m, V] float32; None when m is 0


def keyed_noise(states: RequestStates, packed: PackedBatch, vocab: int) -> KeyedNoise | None:
    """The noise of the step's seeded requests' logits rows, each keyed to the position it
    samples: a request verifying k drafts has rows first .. first + k, sampling its context
    length after the step less k, then one on (without drafts: its context length, the
    host's token count plus the token a step still on the device drew when the step was built
    one ahead). Requests mid-prefill, whose tokens are dropped, get none. None where the batch
    has no seeded request, or the step takes its drafts from the device (`packed.shift`: their
    positions are known there only; they are drawn by position on the host)."""
    batch = states.input_batch
    if not batch.generators or packed.shift is not None:
        return None
    num_draft = packed.num_draft_tokens.astype(np.int64)
    first_row = offsets(num_draft + 1)
    requests = [i for i in sorted(batch.generators) if not packed.discard[i]]
    rows, owners, positions = verification_rows(
        requests, first_row, num_draft, packed.seq_lens - num_draft
    )
    seeds = [position_seed(_seed(states, i), p) for i, p in zip(owners, positions)]
    if not rows:
        return KeyedNoise(np.zeros(0, np.int64), None)
    exponentials = torch.empty((len(rows), vocab), dtype=torch.float32)

    def draw(j: int) -> None:  # torch lets the GIL go while it draws
        exponentials[j].exponential_(generator=torch.Generator().manual_seed(seeds[j]))

    if len(seeds) == 1:
        draw(0)
    else:
        list(_noise_threads().map(draw, range(len(seeds))))
    return KeyedNoise(np.array(rows, np.int64), mx.array(exponentials.numpy()))


@functools.cache
def _noise_threads() -> ThreadPoolExecutor:
    """Threads drawing seeded rows' noise side by side (a row of a 150k-token vocabulary takes
    about 2.5 ms on one core of an x86 server CPU)."""
    return ThreadPoolExecutor(min(4, os.cpu_count() or 1), thread_name_prefix="seeded-noise")


def _params(states: RequestStates, index: int) -> SamplingParams | None:
    return states.requests[states.input_batch.req_ids[index]].sampling_params


def _metadata(
    states: RequestStates, owners: list[int], generators: dict[int, torch.Generator]
) -> SamplingMetadata:
    """Sampling metadata for logits rows of the given batch rows (one row per position), with
    each row's temperature, min-p, top-k and top-p and nothing else (its other rules are
    applied to the rows before, `sample.sample_step`)."""
    batch: InputBatch = states.input_batch
    index = torch.tensor(owners, dtype=torch.long)
    metadata = sampling_metadata(
        batch.temperature_cpu_tensor[index].float(),
        generators,
        top_k=None if batch.no_top_k else batch.top_k_cpu_tensor[index],
        top_p=None if batch.no_top_p else batch.top_p_cpu_tensor[index],
    )
    metadata.logitsprocs = _min_p(states, owners)
    return metadata


def _min_p(states: RequestStates, owners: list[int]) -> LogitsProcessors:
    """vLLM's min-p processor holding each owner's min-p for its logits row (none if no owner
    asks for min-p, or where vLLM built none for the batch: under speculative decoding)."""
    params = [_params(states, i) for i in owners]
    built = any(
        isinstance(p, MinPLogitsProcessor) for p in states.input_batch.logitsprocs.argmax_invariant
    )
    if not built or not any(p is not None and p.min_p for p in params):
        return LogitsProcessors()
    processor = MinPLogitsProcessor(states.vllm_config, torch.device("cpu"), False)
    added = [(row, p, None, []) for row, p in enumerate(params)]
    processor.update_state(BatchUpdate(len(owners), removed=[], added=added, moved=[]))
    return LogitsProcessors([processor])


def sampling_metadata(
    temperature: torch.Tensor,
    generators: dict[int, torch.Generator],
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> SamplingMetadata:
    """vLLM's metadata for seeded random rows that read nothing but their logits, temperature,
    top-k and top-p."""
    empty = torch.empty(0)
    return SamplingMetadata(
        temperature=temperature,
        all_greedy=False,
        all_random=True,
        top_p=top_p,
        top_k=top_k,
        generators=generators,
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=empty,
        presence_penalties=empty,
        repetition_penalties=empty,
        output_token_ids=[],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
