"""What a proposer does for the runner: drafts after each step, and, for one with a model of
its own, its share of the weights, the KV cache and sleep mode (none by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState


class Drafter:
    def propose(
        self,
        step: StepState,
        states: RequestStates,
        sampled: list[list[int]],
        caps: np.ndarray,
    ) -> list[list[int]]:
        """Drafts for each row of the batch, called once the step's tokens are recorded.
        caps[i] is the most drafts row i may use (0: none); longer lists are cut."""
        raise NotImplementedError

    def reset(self, req_id: str) -> None:
        """Forget what was computed for a request (finished, preempted or restarted)."""
        return

    def load(self) -> None:
        return None

    @property
    def weight_bytes(self) -> int:
        return 0

    @property
    def kv_bytes(self) -> int:
        return 0

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        return {}

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        return None

    def discard(self, tags: tuple[str, ...]) -> None:
        return None

    def wake_up(self, tags: list[str]) -> None:
        return None
