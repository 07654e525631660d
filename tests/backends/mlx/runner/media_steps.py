"""The runner's multimodal path driven as vLLM's scheduler drives it, for several requests at
once and any vision-language adapter: each step packs every unfinished request's next prompt
chunk (or one decode token), encodes the items the step first reaches, merges their rows, gives
M-RoPE positions to M-RoPE models and key ends to prefix-LM models, and runs the paged forward
with the adapter's own layer windows and KV shapes (one block table, as the runner's warm-up
lays it out); greedy.

`keep_items_whole` is vLLM's `disable_chunked_mm_input` rule (the platform sets it for prefix-LM
models): a chunk that would start before an item and end inside it stops before the item.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import pack_batch
from vllm_metal.backends.mlx.runner.forward import forward
from vllm_metal.backends.mlx.runner.mm.embeddings import EncoderCache
from vllm_metal.backends.mlx.runner.mm.mrope import step_positions
from vllm_metal.backends.mlx.runner.mm.spans import step_key_ends
from vllm_metal.backends.mlx.runner.model_states import StepInputs
from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.models.layers import memory_layers

if TYPE_CHECKING:
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

BLOCK_SIZE = 16


def request_state(req_id: str, prompt_token_ids: list[int], features: list) -> CachedRequestState:
    """vLLM's runner-side view of a new request: its prompt and its `MultiModalFeatureSpec`s."""
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        mm_features=features,
        sampling_params=None,
        generator=None,
        block_ids=([],),
        num_computed_tokens=0,
        output_token_ids=[],
    )


def _chunk(state: CachedRequestState, computed: int, chunk: int, keep_items_whole: bool) -> int:
    n = min(chunk, len(state.prompt_token_ids) - computed)
    if keep_items_whole:
        for feature in state.mm_features:
            start = feature.mm_position.offset
            if computed < start < computed + n < start + feature.mm_position.length:
                return start - computed
    return n


def run_greedy(
    adapter,
    states: Mapping[str, CachedRequestState],
    *,
    chunk: int,
    new_tokens: int,
    keep_items_whole: bool = False,
    key_ends: bool = True,
    block_size: int = BLOCK_SIZE,
    prompt_logits: dict[str, np.ndarray] | None = None,
    quant=None,
) -> dict[str, tuple[list[int], np.ndarray]]:
    """Each request's `new_tokens` greedy tokens and the logits of its prompt's last token.
    `key_ends=False` drops the prefix-LM key ends (every token causal), for negative controls.
    A hybrid's state layers keep their pages in their own regions' blocks (`block_size` large
    enough that a block's K and V hold a state page). A `prompt_logits` dict is filled with each
    request's logits of every prompt token (`[prompt tokens, vocab]`, the rows vLLM's prompt
    logprobs read). `quant`: a quantized cache of `kv.quant` (the pool's pages in its format)."""
    req_ids = list(states)
    lengths = [len(states[r].prompt_token_ids) + new_tokens for r in req_ids]
    blocks = [-(-n // block_size) for n in lengths]
    table = np.zeros((len(req_ids), max(blocks)), dtype=np.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = np.arange(sum(blocks[:i]), sum(blocks[: i + 1]))
    attn = next(layer.self_attn for layer in adapter.decoder.layers if hasattr(layer, "self_attn"))
    kinds = adapter.layer_kinds()
    # A layer reading an earlier layer's K/V (Gemma 4) reads that layer's region; layers with
    # their own KV heads and head size have regions of their shape.
    memory_of = memory_layers(kinds)
    pool = pool_for(
        KVLayout.single_group(adapter.num_layers, sum(blocks), block_size, memory_of),
        kinds,
        getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads,  # Qwen3-Next's name
        attn.head_dim,
        mx.float32,
        quant,
    )
    tokens = {r: list(states[r].prompt_token_ids) for r in req_ids}
    computed = dict.fromkeys(req_ids, 0)
    new = {r: [] for r in req_ids}
    first: dict[str, np.ndarray] = {}
    prompt_parts: dict[str, list[np.ndarray]] = {r: [] for r in req_ids}
    cache = EncoderCache()
    while active := [r for r in req_ids if len(new[r]) < new_tokens]:
        scheduled = {
            r: _chunk(states[r], computed[r], chunk, keep_items_whole)
            if computed[r] < len(states[r].prompt_token_ids)
            else 1
            for r in active
        }
        encode = {
            r: [
                k
                for k, f in enumerate(states[r].mm_features)
                if f.identifier not in cache.outputs
                and f.mm_position.offset < computed[r] + scheduled[r]
                and f.mm_position.offset + f.mm_position.length > computed[r]
            ]
            for r in active
        }
        step = SimpleNamespace(
            free_encoder_mm_hashes=[],
            scheduled_encoder_inputs={r: ks for r, ks in encode.items() if ks},
        )
        width = max(lengths)
        packed = pack_batch(
            active,
            scheduled,
            np.array([computed[r] for r in active]),
            np.array([len(tokens[r]) for r in active]),
            np.array([tokens[r] + [0] * (width - len(tokens[r])) for r in active]),
            [table[[req_ids.index(r) for r in active]]],
            [block_size],
        )
        cache.update(step, states, adapter)
        rows = cache.step_rows(packed, states)
        positions = step_positions(packed, states, adapter) if adapter.uses_mrope else None
        ends = step_key_ends(packed, states) if adapter.bidirectional_media and key_ends else None
        inputs = StepInputs(mm_rows=rows, mrope_positions=positions, key_ends=ends)
        prompt_rows = {}
        if prompt_logits is not None:
            cu = packed.cu_seqlens_q
            prompt_rows = {
                r: np.arange(cu[i], cu[i + 1])
                for i, r in enumerate(active)
                if computed[r] < len(states[r].prompt_token_ids)
            }
        logits, rows_logits = forward(adapter, pool, kinds, packed, prompt_rows, inputs)
        for r, part in rows_logits.items():
            prompt_parts[r].append(np.array(part))
        for i, r in enumerate(active):
            computed[r] += scheduled[r]
            if computed[r] < len(tokens[r]):
                continue  # mid-prefill: the sampled token is discarded
            first.setdefault(r, np.array(logits[i]))
            tokens[r].append(int(mx.argmax(logits[i]).item()))
            new[r].append(tokens[r][-1])
    if prompt_logits is not None:
        prompt_logits.update({r: np.concatenate(prompt_parts[r]) for r in req_ids})
    return {r: (new[r], first[r]) for r in req_ids}
