"""The layers swapped on MLX's CPU device (`backends/mlx/cpu_layers.py`) compute what MLX's own
`mx.fast.rope` and `mx.fast.rms_norm` compute there, value for value, and a loaded decoder with
them gives the logits it gave before."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn

from vllm_metal.backends.mlx import cpu_layers
from vllm_metal.ops import _backend

needs_native = pytest.mark.skipif(
    _backend.native() is None, reason="the RoPE swap runs the native rotary embedding"
)

SHAPES_AND_OFFSETS = [
    ((5, 4, 1, 64), [0, 7, 100, 3000, 4095]),  # packed rows: one token each, its own position
    ((2, 3, 6, 64), 11),  # a prompt chunk of 6 tokens per row from position 11
    ((1, 2, 9, 64), "scalar array 17"),
    ((3, 2, 4, 64), [1, 2, 3]),
    ((2, 5, 64), [4, 9]),  # [B, L, D]
    ((2, 2, 3, 4, 64), 2),  # [B, ..., L, D]
]


@needs_native
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(("dims", "base", "scale"), [(64, 1e6, 1.0), (32, 1e4, 0.5)])
@pytest.mark.parametrize(("shape", "offset"), SHAPES_AND_OFFSETS)
def test_table_rope_equals_mlx_rope(traditional, dims, base, scale, shape, offset):
    """Whole and partial rotary dims, both styles, a position scale, int and array offsets:
    the same values as `nn.RoPE` (MLX's RoPE graph on the CPU)."""
    if offset == "scalar array 17":
        offset = mx.array(17)
    elif isinstance(offset, list):
        offset = mx.array(offset)
    rope = nn.RoPE(dims, traditional, base, scale)
    swapped = cpu_layers.TableRoPE(rope, cpu_layers.rope_table(dims, base, scale, 4096))
    x = mx.random.normal(shape, key=mx.random.key(len(shape)))
    want, got = rope(x, offset=offset), swapped(x, offset=offset)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_compiled_rms_norm_equals_mlx_rms_norm(dtype):
    norm = nn.RMSNorm(64, eps=1e-6)
    norm.weight = mx.random.normal((64,), key=mx.random.key(1)).astype(dtype)
    swapped = cpu_layers.CompiledRMSNorm.of(norm)
    for shape in [(1, 64), (7, 3, 64), (2, 1, 4, 64)]:
        x = mx.random.normal(shape, key=mx.random.key(2)).astype(dtype)
        assert mx.array_equal(swapped(x), norm(x)).item()
    assert [name for name, _ in swapped.parameters().items()] == ["weight"]


@needs_native
def test_a_decoder_with_the_layers_swapped_gives_the_same_logits(tiny_model_dir):
    """The tiny Qwen3 (RoPE once per attention, RMSNorm before and after it and on its queries
    and keys): every one of those modules swapped, and mlx-lm's own forward over a prompt gives
    the logits it gave before."""
    from vllm_metal.models import load_model

    adapter = load_model(str(tiny_model_dir("qwen3")), compute_dtype=mx.float32)
    model = adapter.model
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    before = model(tokens)
    layers = len(model.layers)
    assert cpu_layers.install(model, max_position=64) == layers * 5 + 1  # 4 norms + RoPE each
    ropes = [m for _, m in model.named_modules() if isinstance(m, cpu_layers.TableRoPE)]
    assert len(ropes) == layers and all(r._table is ropes[0]._table for r in ropes)
    assert mx.array_equal(model(tokens), before).item()
