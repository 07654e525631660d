"""What a proposer does for the runner: drafts after each step, and, for one with a model of
its own, its share of the weights, the KV cache and sleep mode (none by default).
`HeadWeights`: sleep mode for a proposer whose weights are one module. `PagedDrafter`: a
proposer whose attention layers keep K/V in vLLM's KV-cache groups."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from vllm_metal.kv import turboquant
from vllm_metal.kv.pool import KVLayout, KVPool, pool_for
from vllm_metal.kv.quant import KVCacheQuant, PerTokenHeadCache, kv_cache_quant
from vllm_metal.kv.spec import kv_cache_specs

if TYPE_CHECKING:
    import mlx.core as mx
    import torch
    from vllm.config import CacheConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.step import StepState
    from vllm_metal.models import LayerKind


class Drafter:
    # Whether `propose` reads the target's final hidden states of the step (`StepState.hidden`).
    reads_hidden_states = False
    # Whether `propose` attends over the target's K/V of the step (`StepState.kv_pool`).
    reads_target_kv = False
    # The target layers whose input hidden states `propose` reads (`StepState.aux_hidden`: an
    # EAGLE-3 head's aux states); empty: none are kept.
    aux_layer_ids: tuple[int, ...] = ()

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

    def may_queue(self, step: StepState, states: RequestStates) -> bool:
        """Whether the drafts after a step that verifies drafts may be proposed on the device
        behind it, before its tokens are known (`queue`). Only a head does it
        (`spec_decode/ahead.py`)."""
        return False

    def queue(self, step: StepState, states: RequestStates, caps: np.ndarray) -> None:
        """Where `may_queue`: the drafts after `step` queued on the device where it can
        (`StepState.queued`, which `propose` reads), each row proposing up to `caps[i]`."""
        return

    def keeps_up(self, step: StepState, states: RequestStates, num_sampled: np.ndarray) -> bool:
        """Where no row drafts after `step`: do now what `propose` would, before the step's
        tokens reach the host (`num_sampled[i]` of them per row, not yet in the batch), and say
        whether that was possible. Proposers that work only for drafting rows have nothing to
        do."""
        return True

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


class HeadWeights:
    """Sleep mode for a drafter whose weights are one module, `head`, read by its `load`."""

    head = None

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


def sampled_counts(sampled: list[list[int]]) -> np.ndarray:
    """The tokens each row sampled in a step (`[rows]` int32)."""
    return np.fromiter((len(s) for s in sampled), dtype=np.int32, count=len(sampled))


def block_tables(states: RequestStates, num_groups: int) -> list[np.ndarray]:
    """The persistent batch's block table of each KV-cache group, one row per request."""
    batch = states.input_batch
    n = batch.num_reqs
    return [batch.block_table[g].get_numpy_array()[:n] for g in range(num_groups)]


class PagedDrafter(Drafter):
    """A drafter with attention layers of its own, declared to vLLM beside the target's (named
    `layer_names`, with `kinds`), so vLLM's KV sizing counts them and they share the target's
    KV-cache group: they read its block tables and write at the same slots. The subclass sets
    `layer_names` and `kinds` when it loads. `cache_config`: the draft's (`kv.quant.
    draft_cache_config`): a quantized `--kv-cache-dtype` quantizes the drafter's pages too, as
    vLLM's draft layers inherit it; None: the model's dtype. `first_layer_index`: the index vLLM
    reads from the name of the drafter's first layer (under TurboQuant, layers whose index the
    skip list names keep the model's dtype, as vLLM's draft layers do)."""

    first_layer_index = 0

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: mx.Dtype,
        cache_config: CacheConfig | None = None,
    ):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.cache_config = cache_config
        self.layer_names: list[str] = []
        self.kinds: list[LayerKind] = []
        self.layout: KVLayout | None = None
        self.pool: KVPool | None = None

    @property
    def kv_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.nbytes

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[str, KVCacheSpec]:
        assert self.layer_names, "load the drafter first"
        return kv_cache_specs(
            self.layer_names,
            self.kinds,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            cache_config=self.cache_config,
            first_layer_index=self.first_layer_index,
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.layout = KVLayout.from_config(kv_cache_config, self.layer_names)
        self._allocate()

    def _allocate(self) -> None:
        # Latent (MLA) layers get a latent pool (`kv.latent`), the others K and V.
        self.pool = pool_for(
            self.layout, self.kinds, self.num_kv_heads, self.head_dim, self.kv_dtype, self._quant()
        )

    def _quant(self) -> KVCacheQuant | PerTokenHeadCache | turboquant.TurboQuantCache | None:
        """The drafter's quantized cache (fp8 at vLLM's default scales, 1.0, per-token-head, or
        TurboQuant); None for its model's dtype."""
        if self.cache_config is None:
            return None
        if turboquant.requested(self.cache_config.cache_dtype):
            return turboquant.TurboQuantCache.of(
                self.cache_config, self.kinds, self.first_layer_index
            )
        return kv_cache_quant(self.cache_config.cache_dtype, len(self.kinds))

    def discard(self, tags: tuple[str, ...]) -> None:
        if "kv_cache" in tags:
            self.pool = None

    def wake_up(self, tags: list[str]) -> None:
        if "kv_cache" in tags and self.pool is None and self.layout is not None:
            self._allocate()
