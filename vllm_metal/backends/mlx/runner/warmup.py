"""Profiling and warm-up: dummy prefills through a scratch KV pool.

`profile_run` measures the activation peak of a full-size step (what the worker subtracts from
the memory budget); `warm_up` runs the shapes of a first decode and a first prefill chunk so the
first request does not pay for MLX's one-time setup.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from vllm_metal.backends.mlx.runner.batch import PackedBatch, decode_batch, prefill_batch
from vllm_metal.backends.mlx.runner.forward import forward, hidden_states
from vllm_metal.kv.pool import KVLayout, KVPool, pool_for
from vllm_metal.kv.quant import KVCacheQuant
from vllm_metal.models import ModelAdapter
from vllm_metal.models.layers import LayerKind, memory_layers


def activation_peak(run: Callable[[], None]) -> int:
    """Peak bytes `run` allocates beyond what is allocated before it."""
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    run()
    return max(0, int(mx.get_peak_memory() - before))


class DummyRuns:
    def __init__(
        self,
        adapter: ModelAdapter,
        kinds: Sequence[LayerKind],
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: mx.Dtype,
        vocab_size: int,
        *,
        logits: bool = True,
        quant: KVCacheQuant | None = None,
    ):
        self.adapter = adapter
        self.quant = quant  # an fp8 cache (`kv.quant`): the dummy steps run its paths
        self.logits = logits  # False: a pooling model, whose steps end at the hidden states
        self.kinds = list(kinds)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.vocab_size = vocab_size

    def _pool(self, num_blocks: int, block_size: int) -> KVPool:
        memory_of = memory_layers(self.kinds)
        layout = KVLayout.single_group(len(self.kinds), num_blocks, block_size, memory_of)
        return pool_for(
            layout, self.kinds, self.num_kv_heads, self.head_dim, self.kv_dtype, self.quant
        )

    def _prefill(self, num_tokens: int, pool: KVPool) -> None:
        self._run(prefill_batch(num_tokens, pool.block_size, 1, self.vocab_size), pool)

    def _run(self, packed: PackedBatch, pool: KVPool) -> None:
        if self.logits:
            mx.eval(forward(self.adapter, pool, self.kinds, packed, {})[0])
        else:
            mx.eval(hidden_states(self.adapter, pool, self.kinds, packed))

    def _decode(self, position: int, pool: KVPool) -> None:
        """One token at `position` of the sequence `_prefill` left in blocks 0, 1, ..."""
        table = np.arange(pool.num_blocks, dtype=np.int32)[None, :]
        token = np.array([position % max(2, self.vocab_size - 1)])
        self._run(
            decode_batch(["dummy"], np.array([position]), token, [table], [pool.block_size]), pool
        )

    def profile(self, num_tokens: int, block_size: int) -> int:
        """Peak bytes a prefill of `num_tokens` needs beyond what is allocated now."""
        # The scratch pool is allocated before the measurement starts and freed after it.
        run = functools.partial(
            self._prefill, num_tokens, self._pool(math.ceil(num_tokens / block_size), block_size)
        )
        peak = activation_peak(run)
        del run
        mx.clear_cache()
        return peak

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        """A one-token prefill, a prefill of one block (or the step budget) and a decode step
        after it that reads those K/V back: the shapes of a first request, and every layer's
        cache written and read once."""
        pool = self._pool(2, block_size)
        n = min(block_size, max_num_tokens)
        for length in (1, n):
            self._prefill(length, pool)
        self._decode(n, pool)
        del pool
        mx.clear_cache()
