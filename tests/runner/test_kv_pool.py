"""KV pool block copies (copy-on-write of shared prefix blocks) move whole blocks in every layer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from vllm_metal.runner.paged import KVPool


def test_copy_blocks_copies_every_layer_and_leaves_others():
    pool = KVPool(num_layers=3, num_blocks=6, block_size=8, num_kv_heads=2, head_dim=64,
                  dtype=mx.float32)
    rng = np.random.default_rng(0)
    for layer in range(3):
        pool.keys[layer] = mx.array(rng.standard_normal((6, 8, 2, 64)).astype(np.float32))
        pool.values[layer] = mx.array(rng.standard_normal((6, 8, 2, 64)).astype(np.float32))
    before_k = [np.array(a) for a in pool.keys]
    before_v = [np.array(a) for a in pool.values]
    pool.copy_blocks([1, 4], [3, 0])
    for layer in range(3):
        k, v = np.array(pool.keys[layer]), np.array(pool.values[layer])
        np.testing.assert_array_equal(k[3], before_k[layer][1])
        np.testing.assert_array_equal(k[0], before_k[layer][4])
        np.testing.assert_array_equal(v[3], before_v[layer][1])
        np.testing.assert_array_equal(v[0], before_v[layer][4])
        for untouched in (1, 2, 4, 5):
            np.testing.assert_array_equal(k[untouched], before_k[layer][untouched])
            np.testing.assert_array_equal(v[untouched], before_v[layer][untouched])
