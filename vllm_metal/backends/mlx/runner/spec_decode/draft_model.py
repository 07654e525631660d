"""Drafts from a smaller model that shares the target's tokenizer, with a paged KV cache of its
own.

The draft's attention layers are declared to vLLM beside the target's (names prefixed with
`draft.`), so they take part in vLLM's KV sizing and live in the same KV-cache group: the draft
reads the target's block tables and writes its K/V at the same slots. A request that drafts after a step first
catches up: one pass over every token of its sequence the draft has not seen yet (after a
verified row, the accepted drafts and the new token; at its first draft, the whole sequence), then
one token at a time for the remaining drafts, at positions the scheduler reserved as lookahead
slots. A request that does not draft costs the draft nothing. The draft never relies on K/V it
did not write for that request itself, so prefix-cache hits and preemption need no special care. Drafts are the draft model's argmax (vLLM's
`draft_sample_method="greedy"`), so verification treats them as one-hot proposals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx import cpu_layers
from vllm_metal.backends.mlx.device import device_kind
from vllm_metal.backends.mlx.runner.batch import PackedBatch, decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import forward
from vllm_metal.backends.mlx.runner.spec_decode.drafter import PagedDrafter, block_tables
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models import ModelAdapter, load_model
from vllm_metal.ops.argmax import row_argmax

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState

# Prefix of the draft model's layer names in vLLM's KV-cache config.
DRAFT_LAYER_PREFIX = "draft."


class DraftModelDrafter(PagedDrafter):
    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        compute_dtype: mx.Dtype,
        kv_dtype: mx.Dtype,
        dequantize: bool,
    ):
        spec = vllm_config.speculative_config
        self.model_config = spec.draft_model_config
        super().__init__(
            self.model_config.get_num_kv_heads(spec.draft_parallel_config),
            self.model_config.get_head_size(),
            kv_dtype,
            draft_cache_config(vllm_config),
        )
        self.download_dir = vllm_config.load_config.download_dir
        self.compute_dtype = compute_dtype
        self.dequantize = dequantize
        self.adapter: ModelAdapter | None = None
        self.seen: dict[str, int] = {}  # req_id -> tokens of it whose K/V the draft wrote

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        self.adapter = adapter = load_model(
            self.model_config.model,
            compute_dtype=self.compute_dtype,
            dequantize=self.dequantize,
            revision=self.model_config.revision,
            download_dir=self.download_dir,
            trust_remote_code=self.model_config.trust_remote_code,
        )
        if device_kind() == "cpu":
            cpu_layers.install(adapter.model, self.model_config.max_model_len)
        self.kinds = adapter.layer_kinds()
        self.layer_names = [DRAFT_LAYER_PREFIX + n for n in adapter.attention_layer_names]

    @property
    def weight_bytes(self) -> int:
        return 0 if self.adapter is None else self.adapter.weight_bytes

    def discard(self, tags: tuple[str, ...]) -> None:
        super().discard(tags)
        if "kv_cache" in tags:
            self.seen.clear()
        if "weights" in tags:
            self.adapter = None

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and self.adapter is None:
            self.load()
        super().wake_up(tags)

    # ------------------------------------------------------------ drafting

    def reset(self, req_id: str) -> None:
        self.seen.pop(req_id, None)

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.adapter is not None and self.pool is not None, "draft model not ready"
        batch = states.input_batch
        packed = step.packed
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        tables = block_tables(states, len(packed.block_tables))
        block_sizes = states.block_sizes

        # The sequence after this step: what the target consumed and kept, plus the new token.
        start = packed.seq_lens - packed.num_scheduled
        kept = packed.num_scheduled - packed.num_draft_tokens
        end = start + kept + np.fromiter((len(s) for s in sampled), dtype=np.int32, count=n)
        drafts: list[list[int]] = [[] for _ in range(n)]
        rows = np.nonzero(caps > 0)[0]
        if rows.size == 0:
            return drafts
        # Catch up each drafting request on the tokens it has not seen; the last one's logits
        # give its first draft.
        seen = np.array([min(self.seen.get(req_ids[r], 0), int(end[r]) - 1) for r in rows])
        first = pack_batch(
            [req_ids[r] for r in rows],
            {req_ids[r]: int(end[r] - s) for r, s in zip(rows, seen)},
            seen,
            end[rows],
            batch.token_ids_cpu[rows],
            [t[rows] for t in tables],
            block_sizes,
        )
        for r, token in zip(rows, self._next_tokens(first)):
            drafts[r].append(int(token))
            self.seen[req_ids[r]] = int(end[r])
        # One token at a time: draft j sits at position end - 1 + j.
        for j in range(1, int(caps.max(initial=0))):
            rows = rows[caps[rows] > j]
            if rows.size == 0:
                break
            step_batch = decode_batch(
                [req_ids[r] for r in rows],
                end[rows] - 1 + j,
                np.array([drafts[r][-1] for r in rows], dtype=np.int32),
                [t[rows] for t in tables],
                block_sizes,
            )
            for r, token in zip(rows, self._next_tokens(step_batch)):
                drafts[r].append(int(token))
        return drafts

    def _next_tokens(self, packed: PackedBatch) -> np.ndarray:
        """The argmax at `packed.logits_indices`, with the step's K/V written to the pool."""
        logits, _ = forward(self.adapter, self.pool, self.kinds, packed, {})
        tokens = row_argmax(logits)
        mx.eval(tokens, *self.pool.arrays())
        return np.array(tokens)
