"""State layers on a step that verifies drafts (speculative decoding on a hybrid model).

A request verifying `k` drafts sends `k + 1` tokens `[last sampled, d1..dk]`, and only some of
them are accepted: its state must become the state after the accepted ones, which the step
learns only once its logits are sampled. The state ops return the state after a sequence's last
token, so the step runs each state layer over expanded rows: such a request becomes `k + 1`
sequences, its first 1, 2, ..., `k + 1` tokens, all starting from its page. Their outputs at
their last token are the layer's outputs at those positions (a token's output depends only on
the state before it and the token), and their final states are the candidates: the state after
each of the request's tokens. Requests without drafts (prefill chunks, plain decode) stay one
sequence and write their page as on any step.

`StepDrafts.commit` then stores, for each verifying request, the candidate after its accepted
tokens in the page of its last accepted token, and in align mode (`kv.state`) also the candidate
at a block boundary the accepted tokens cross, in that block's page, so cached pages hold their
boundary states as without speculation. The price: `(k + 1)(k + 2) / 2` rows through each state
layer instead of `k + 1`, for the verifying requests only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from vllm_metal.kv.state import StateBlocks, StateLayerCache, page_column

if TYPE_CHECKING:
    from collections.abc import Callable


class StepDrafts:
    """The expanded rows of one step and the candidate states its state layers leave."""

    def __init__(self, num_scheduled: np.ndarray, num_draft_tokens: np.ndarray):
        """Per request: tokens scheduled and drafts among them (a verifying request's tokens are
        its last sampled token and its drafts)."""
        num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
        drafts = np.asarray(num_draft_tokens, dtype=np.int64)
        self.verifying = drafts > 0
        if (num_scheduled[self.verifying] != drafts[self.verifying] + 1).any():
            raise ValueError("a request verifying drafts must schedule its drafts plus one token")
        starts = np.concatenate([[0], np.cumsum(num_scheduled)[:-1]])
        rows: list[int] = []
        back = np.zeros(int(num_scheduled.sum()), dtype=np.int32)  # output row of each row
        lengths, owner, first = [], [], []
        for r, (start, n) in enumerate(zip(starts.tolist(), num_scheduled.tolist())):
            first.append(len(lengths))
            if not self.verifying[r]:
                back[start : start + n] = np.arange(len(rows), len(rows) + n)
                rows.extend(range(start, start + n))
                lengths.append(n)
                owner.append(r)
                continue
            for end in range(1, n + 1):  # its first `end` tokens
                rows.extend(range(start, start + end))
                back[start + end - 1] = len(rows) - 1
                lengths.append(end)
                owner.append(r)
        self.rows = mx.array(np.array(rows, dtype=np.int32))
        self.back = mx.array(back)
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        self.cu_seqlens = mx.array(cu)
        self.num_scheduled = num_scheduled
        self.owner = np.array(owner, dtype=np.int64)  # [S'] request of each sequence
        self.first = np.array(first, dtype=np.int64)  # [S] each request's first sequence
        self.sequence_verifies = self.verifying[self.owner]
        # Each state group's pages over the expanded sequences (id of the step's StateBlocks ->
        # those blocks and their expansion), made once for all the group's layers.
        self._expanded: dict[int, tuple[StateBlocks, StateBlocks]] = {}
        # Candidate states of the verifying sequences, per state layer.
        self.pending: list[tuple[StateLayerCache, mx.array, mx.array]] = []

    def run(
        self,
        call: Callable[[Any, mx.array, StateLayerCache], mx.array],
        layer: Any,
        x: mx.array,
        cache: StateLayerCache,
    ) -> mx.array:
        """`call` over the expanded rows; its outputs at the step's rows."""
        view = StateLayerCache(
            cache.pool, cache.region, cache.shapes, self._expand(cache.blocks), self.cu_seqlens
        )
        view.drafts = self
        return call(layer, x[self.rows], view)[self.back]

    def _expand(self, b: StateBlocks) -> StateBlocks:
        """`b` (one entry per request) with one entry per expanded sequence."""
        made = self._expanded.get(id(b))
        if made is None:
            o = self.owner
            expanded = StateBlocks(
                b.read[o], b.write[o], b.fresh[o], b.table[o], b.computed[o], b.block_size
            )
            made = self._expanded[id(b)] = (b, expanded)
        return made[1]

    def write(self, view: StateLayerCache, conv: mx.array, recurrent: mx.array) -> None:
        """Store the non-verifying sequences' states now; keep the verifying ones' candidates."""
        plain = np.nonzero(~self.sequence_verifies)[0]
        if len(plain):
            keep = mx.array(plain.astype(np.int32))
            view.store(conv[keep], recurrent[keep], view.blocks.write[plain])
        verifying = np.nonzero(self.sequence_verifies)[0]
        if len(verifying):
            pick = mx.array(verifying.astype(np.int32))
            self.pending.append((view, conv[pick], recurrent[pick]))

    def arrays(self) -> list[mx.array]:
        """The candidates, to evaluate with the step."""
        return [a for _, conv, recurrent in self.pending for a in (conv, recurrent)]

    def commit(self, accepted: np.ndarray) -> None:
        """Store each verifying request's state after its accepted drafts (`accepted[r]`, per
        request of the step; ignored for the others) in its pages."""
        if not self.pending:
            return
        blocks = self.pending[0][0].blocks  # tokens computed and block size: alike in groups
        picks, pages = [], []  # candidate row (in `pending`), (table row, column) of its page
        base = 0
        for r in np.nonzero(self.verifying)[0].tolist():
            seq = int(self.first[r])
            n = int(self.num_scheduled[r])  # its tokens: last sampled + drafts
            kept = 1 + min(int(accepted[r]), n - 1)
            done, size = int(blocks.computed[seq]), blocks.block_size
            # Block boundaries the kept tokens cross, then the last kept token.
            ends = [*range((done // size + 1) * size, done + kept, size), done + kept]
            for end in ends:
                picks.append(base + end - done - 1)
                pages.append((seq, int(page_column(np.array(end), size))))
            base += n
        sel = mx.array(np.array(picks, dtype=np.int32))
        for view, conv, recurrent in self.pending:
            blocks = np.array([view.blocks.table[seq, col] for seq, col in pages])
            view.store(conv[sel], recurrent[sel], blocks)
        self.pending.clear()
