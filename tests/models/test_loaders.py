"""The safetensors loader: MLX-quantized checkpoints are served dense in float32 on the CPU when
asked (same outputs as the quantized layers), and stay quantized otherwise."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from vllm_metal.models.loaders import safetensors


def _quantized_layers(model) -> int:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    return sum(isinstance(m, kinds) for _, m in model.named_modules())


def test_dequantized_model_computes_what_the_quantized_one_does(tiny_quantized_dir):
    path = tiny_quantized_dir("qwen3", bits=4, group_size=64)
    quantized, _ = safetensors.load(str(path), mx.float32)
    dense, _ = safetensors.load(str(path), mx.float32, dequantize=True)
    assert _quantized_layers(quantized) > 0
    assert _quantized_layers(dense) == 0
    tokens = mx.array([[5, 17, 301, 42, 9, 600]])
    ref = np.array(quantized(tokens))
    got = np.array(dense(tokens))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_a_dense_checkpoint_loads_the_same_either_way(tiny_model_dir):
    from mlx.utils import tree_flatten

    path = str(tiny_model_dir("qwen3"))
    plain = dict(tree_flatten(safetensors.load(path, mx.float32)[0].parameters()))
    asked = dict(tree_flatten(safetensors.load(path, mx.float32, dequantize=True)[0].parameters()))
    assert plain.keys() == asked.keys()
    for name, value in plain.items():
        assert mx.array_equal(value, asked[name]), name
