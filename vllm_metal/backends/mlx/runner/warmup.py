"""Profiling and warm-up: dummy prefills through a scratch KV pool.

`profile_run` measures the activation peak of a full-size step (what the worker subtracts from
the memory budget); `warm_up` runs the shapes of a first decode and a first prefill chunk so the
first request does not pay for MLX's one-time setup.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from vllm_metal.backends.mlx.runner.batch import prefill_batch
from vllm_metal.backends.mlx.runner.forward import forward
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import ModelAdapter


class DummyRuns:
    def __init__(
        self,
        adapter: ModelAdapter,
        windows: Sequence[int | None],
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: mx.Dtype,
        vocab_size: int,
    ):
        self.adapter = adapter
        self.windows = list(windows)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_dtype = kv_dtype
        self.vocab_size = vocab_size

    def _pool(self, num_blocks: int, block_size: int) -> KVPool:
        layout = KVLayout.single_group(len(self.windows), num_blocks, block_size)
        return KVPool(layout, self.num_kv_heads, self.head_dim, self.kv_dtype)

    def _prefill(self, num_tokens: int, pool: KVPool) -> None:
        packed = prefill_batch(num_tokens, pool.block_size, 1, self.vocab_size)
        logits, _ = forward(self.adapter, pool, self.windows, packed, {})
        mx.eval(logits)

    def profile(self, num_tokens: int, block_size: int) -> int:
        """Peak bytes a prefill of `num_tokens` needs beyond what is allocated now."""
        pool = self._pool(math.ceil(num_tokens / block_size), block_size)
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        self._prefill(num_tokens, pool)
        peak = mx.get_peak_memory() - before
        del pool
        mx.clear_cache()
        return max(0, int(peak))

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        pool = self._pool(2, block_size)
        for n in (1, min(block_size, max_num_tokens)):
            self._prefill(n, pool)
        del pool
        mx.clear_cache()
