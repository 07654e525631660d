"""N-gram drafts: vLLM's own prompt-lookup proposer (numpy + numba) over the request's tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import NgramProposer

from vllm_metal.backends.mlx.runner.spec_decode.drafter import Drafter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState


class NgramDrafter(Drafter):
    def __init__(self, vllm_config: VllmConfig):
        self.proposer = proposer = NgramProposer(vllm_config)
        # Its own warm-up proposes for no request, so numba would compile the search on the
        # first real step (about two seconds); compile it now on one repetitive row.
        row = np.tile(np.arange(1, 5, dtype=np.int32), proposer.max_model_len // 4 + 1)
        tokens = row[None, : proposer.max_model_len]
        proposer.propose(
            proposer.k, [[1]], np.array([min(16, tokens.shape[1])], dtype=np.int32), tokens
        )

    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        batch = states.input_batch
        n = batch.num_reqs
        # A row with no sampled token (mid-prefill) or no room gets no drafts.
        rows = [tokens if cap > 0 else [] for tokens, cap in zip(sampled, caps)]
        return self.proposer.propose(
            int(caps.max(initial=0)),
            rows,
            batch.num_tokens_no_spec[:n],
            batch.token_ids_cpu[:n],
        )
