"""Drafts from the target's own multi-token-prediction head (`--speculative-config
'{"method": "mtp"}'`; the head of each family: `models/families/*_mtp.py`).

The head at position p reads the target's final hidden state at p and the token at p + 1, and
predicts the token at p + 2; its attention layers keep K/V in the target's KV-cache group (names
prefixed `mtp.`), at p's slot. So after every step the head runs over each scheduled request's
new positions whose next token is known (a prefill chunk's tokens, or a decode row's last
token and accepted drafts), with the hidden states the target computed for them in this step:
its K/V then covers each request's whole sequence whether or not the request drafts. For a
request that drafts, the head's output at the last of them gives draft 1; draft j + 1 comes from
the head at the next position, fed draft j and the head's own output before it, as vLLM chains
MTP drafts. What it writes at draft positions is overwritten by the next step's pass, which
starts at the first position not verified. Drafts are the head's argmax (vLLM's
`draft_sample_method="greedy"`). With prefix caching vLLM's scheduler drops the last block of a
hit for MTP drafters, so the head's K/V in a hit's blocks was computed from the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.backends.mlx.runner.spec_decode.drafter import PagedDrafter, block_tables
from vllm_metal.kv.quant import draft_cache_config
from vllm_metal.models.families import mtp_module

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState

# Prefix of the MTP head's layer names in vLLM's KV-cache config.
MTP_LAYER_PREFIX = "mtp."


def new_positions(
    step: StepState, states: RequestStates, sampled: list[list[int]]
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of the batch: the first position the target computed this step, and how many
    positions from there it computed and kept (accepted drafts included) whose next token is
    known. The last of them, where the count is positive, is the position a draft chain starts
    from: its next token is the one just sampled."""
    batch = states.input_batch
    packed = step.packed
    n = batch.num_reqs
    start = packed.seq_lens - packed.num_scheduled
    num_sampled = np.fromiter((len(s) for s in sampled), dtype=np.int32, count=n)
    kept = packed.num_scheduled - packed.num_draft_tokens + np.maximum(num_sampled - 1, 0)
    known = batch.num_tokens_no_spec[:n].astype(np.int32)
    return start, np.minimum(kept, known - 1 - start)


class MTPDrafter(PagedDrafter):
    reads_hidden_states = True

    def __init__(self, vllm_config: VllmConfig, target: ModelState, *, kv_dtype: mx.Dtype):
        model_config = vllm_config.model_config
        super().__init__(
            model_config.get_num_kv_heads(vllm_config.parallel_config),
            model_config.get_head_size(),
            kv_dtype,
            draft_cache_config(vllm_config),
        )
        self.target = target
        self.model_path = model_config.model
        self.revision = model_config.revision
        self.download_dir = vllm_config.load_config.download_dir
        self.head = None

    # ------------------------------------------------------------ memory

    def load(self) -> None:
        from vllm_metal.models.loaders.safetensors import resolve_model_path

        adapter = self.target.adapter
        module = mtp_module(adapter.model_type)
        if module is None:  # the capability table refuses this at startup
            raise ValueError(f"{adapter.model_type}: no multi-token-prediction head is built")
        path = resolve_model_path(self.model_path, self.revision, self.download_dir)
        self.head = module.load_head(adapter.config, path, self.target.compute_dtype)
        self.kinds = self.head.layer_kinds()
        self.layer_names = [
            f"{MTP_LAYER_PREFIX}layers.{i}.self_attn" for i in range(len(self.kinds))
        ]

    @property
    def weight_bytes(self) -> int:
        if self.head is None:
            return 0
        from vllm_metal.models.loaders import parameter_bytes

        return parameter_bytes(self.head)

    def discard(self, tags: tuple[str, ...]) -> None:
        super().discard(tags)
        if "weights" in tags:
            self.head = None

    def wake_up(self, tags: list[str]) -> None:
        if "weights" in tags and self.head is None:
            self.load()
        super().wake_up(tags)

    # ------------------------------------------------------------ drafting

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        assert self.head is not None and self.pool is not None, "MTP head not ready"
        assert step.hidden is not None, "the step kept no hidden states"
        batch = states.input_batch
        packed = step.packed
        n = batch.num_reqs
        req_ids = batch.req_ids[:n]
        tables = block_tables(states, len(packed.block_tables))
        drafts: list[list[int]] = [[] for _ in range(n)]

        start, count = new_positions(step, states, sampled)
        rows = np.nonzero(count > 0)[0]
        if rows.size == 0:
            return drafts
        ids = [req_ids[r] for r in rows]
        # Column p of the shifted table holds the token at p + 1: the head's input at p.
        shifted = batch.token_ids_cpu[rows, 1:]
        first = pack_batch(
            ids,
            dict(zip(ids, count[rows].tolist())),
            start[rows],
            start[rows] + count[rows],
            shifted,
            [t[rows] for t in tables],
            states.block_sizes,
        )
        # The target's hidden states at those positions: the first `count` rows of each request.
        offsets = packed.cu_seqlens_q[rows]
        gather = np.concatenate([o + np.arange(c) for o, c in zip(offsets, count[rows])])
        hidden = step.hidden[mx.array(gather.astype(np.int32))]
        out, fed_back = self._run(first, hidden, 0)

        # Rows that draft: their head output at the last position gives draft 1.
        drafting = [i for i, r in enumerate(rows) if caps[r] > 0]
        if not drafting:
            # Queued, not waited for: no draft is read now, and the next step's reads of the
            # head's K/V come after these writes in MLX's graph.
            mx.async_eval(*self.pool.arrays())
            return drafts
        last = first.cu_seqlens_q[1:][drafting] - 1
        rows = rows[drafting]
        at_last = mx.array(last.astype(np.int32))
        out, fed_back = out[at_last], fed_back[at_last]
        positions = start[rows] + count[rows] - 1
        for j in range(int(caps[rows].max())):
            if j > 0:
                keep = caps[rows] > j
                rows, positions = rows[keep], positions[keep]
                if rows.size == 0:
                    break
                fed_back = fed_back[mx.array(np.nonzero(keep)[0].astype(np.int32))]
                tokens = np.array([drafts[r][-1] for r in rows], dtype=np.int32)
                positions = positions + 1
                fed = decode_batch(
                    [req_ids[r] for r in rows],
                    positions,
                    tokens,
                    [t[rows] for t in tables],
                    states.block_sizes,
                )
                out, fed_back = self._run(fed, fed_back, j)
            tokens = mx.argmax(self.target.adapter.logits(out).reshape(out.shape[0], -1), axis=-1)
            mx.eval(tokens, *self.pool.arrays())
            for r, token in zip(rows, np.array(tokens).tolist()):
                drafts[r].append(int(token))
        return drafts

    def _run(self, packed, hidden: mx.array, step: int) -> tuple[mx.array, mx.array]:
        """The head over `packed` (tokens at p + 1, positions p) with the hidden states of its
        rows, its K/V written to layer `step mod layers`: the normed output the LM head reads,
        and the hidden state a chained step is fed (a head returning one array feeds it back)."""
        caches = layer_caches(self.pool, packed, self.kinds)
        layer = step % len(self.kinds)
        embeds = self.target.adapter.embed(mx.array(packed.token_ids)[:, None])
        out = self.head(embeds, hidden, caches[layer], step)
        return out if isinstance(out, tuple) else (out, out)
