"""`ops.argmax.row_argmax` against `mx.argmax` and numpy on MLX's CPU device, where it takes
the blocked path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.ops.argmax import BLOCK, MIN_BLOCKS, row_argmax


@pytest.mark.parametrize("width", [151_936, MIN_BLOCKS * BLOCK, MIN_BLOCKS * BLOCK + 1, 1000])
def test_equals_mx_argmax(width):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((5, width)).astype(np.float32)
    x[1] = -np.inf  # a row with no finite value: index 0
    x[2, [3 * BLOCK + 7, 5 * BLOCK + 1, 3 * BLOCK + 9]] = 50.0  # ties across and in blocks
    x[3, [width - 1, 0]] = 50.0  # the first and the last element
    x[4, width // 2 :] = 60.0  # a tie over half the row
    got = np.array(row_argmax(mx.array(x)))
    assert mx.default_device() == mx.cpu
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    np.testing.assert_array_equal(got, np.array(mx.argmax(mx.array(x), axis=-1)))
    assert got[2] == 3 * BLOCK + 7 and got[3] == 0


def test_bfloat16_rows():
    x = mx.random.normal((3, 64 * BLOCK), key=mx.random.key(0)).astype(mx.bfloat16)
    np.testing.assert_array_equal(np.array(row_argmax(x)), np.array(mx.argmax(x, axis=-1)))
