"""fp8 KV caches on the KV side: vLLM sizes their pages at one byte per element with its FP8 quant
mode, the pool stores uint8 bytes, and each layer's scales come from the checkpoint (1.0 where it
has none), a layer reading another's K/V with the writer's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from vllm.config import CacheConfig
from vllm.v1.kv_cache_interface import KVQuantMode

from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.kv.quant import kv_cache_quant
from vllm_metal.kv.spec import attention_spec
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind


@pytest.mark.parametrize("kind", [FULL_ATTENTION, LayerKind(sliding_window=8)])
@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_are_one_byte_per_element(kind: LayerKind, dtype: str) -> None:
    plain = attention_spec(kind, 16, 2, 64, torch.float32, CacheConfig(cache_dtype="auto"))
    quantized = attention_spec(kind, 16, 2, 64, torch.float32, CacheConfig(cache_dtype=dtype))
    assert quantized.dtype == torch.uint8
    assert quantized.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
    assert quantized.page_size_bytes * 4 == plain.page_size_bytes == 2 * 16 * 2 * 64 * 4
    assert type(quantized) is type(plain)


def test_scales_come_from_the_checkpoint(tmp_path) -> None:
    tensors = {
        "model.layers.0.self_attn.k_scale": np.array(0.5, np.float32),
        "model.layers.0.self_attn.v_scale": np.array(2.0, np.float32),
        "model.layers.2.self_attn.kv_scale": np.array([0.25, 0.75], np.float32),  # per head
        "model.layers.1.self_attn.q_proj.weight": np.zeros((2, 2), np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    quant = kv_cache_quant("fp8_e5m2", 4, tmp_path)
    assert quant.k_scales == (0.5, 1.0, 0.75, 1.0)
    assert quant.v_scales == (2.0, 1.0, 0.75, 1.0)
    assert kv_cache_quant("auto", 4, tmp_path) is None
    assert kv_cache_quant("fp8", 2, None).k_scales == (1.0, 1.0)


def test_a_bad_scale_is_an_error(tmp_path) -> None:
    save_file(
        {"model.layers.0.self_attn.k_scale": np.array(0.0, np.float32)},
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(ValueError, match="k_scale"):
        kv_cache_quant("fp8", 1, tmp_path)


def test_the_pool_stores_bytes_and_readers_use_the_writers_scales(tmp_path) -> None:
    save_file(
        {f"model.layers.{i}.self_attn.k_scale": np.array(i + 1.0, np.float32) for i in range(2)},
        str(tmp_path / "model.safetensors"),
    )
    kinds = [FULL_ATTENTION, FULL_ATTENTION, LayerKind(kv_source=0)]
    quant = kv_cache_quant("fp8", 3, tmp_path)
    layout = KVLayout.single_group(3, 4, 16, memory_of=[0, 1, 0])
    pool = pool_for(layout, kinds, 2, 64, mx.bfloat16, quant)
    assert pool.dtype == mx.uint8 and pool.row_dtype == mx.bfloat16
    assert all(a.dtype == mx.uint8 for a in pool.arrays())
    assert [q.k_scale for q in pool.layer_quant] == [1.0, 2.0, 1.0]
    assert pool.layer_quant[0].fmt.name == "fp8_e4m3"
    assert not np.asarray(pool.keys[0][0]).any()  # the null block is zero bytes (+0.0)
    assert pool_for(layout, kinds, 2, 64, mx.bfloat16).layer_quant is None


PER_TOKEN_HEAD = ["int8_per_token_head", "fp8_per_token_head", "int4_per_token_head"]


@pytest.mark.parametrize("kind", [FULL_ATTENTION, LayerKind(sliding_window=8)])
@pytest.mark.parametrize("dtype", PER_TOKEN_HEAD)
def test_per_token_head_pages_are_the_ones_vllms_attention_sizes(kind: LayerKind, dtype: str):
    """The page vLLM plans is what vLLM's own attention backend declares for the format
    (`TritonAttentionBackend.customize_spec`: data and one float32 scale per K/V side and head),
    and the pool's arrays for that many blocks hold exactly those bytes."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    spec = attention_spec(kind, 16, 2, 64, torch.bfloat16, CacheConfig(cache_dtype=dtype))
    plain = attention_spec(kind, 16, 2, 64, torch.bfloat16, CacheConfig(cache_dtype="auto"))
    vllms = TritonAttentionBackend.customize_spec(
        type(plain)(
            **{
                **{f: getattr(plain, f) for f in ("block_size", "num_kv_heads", "head_size")},
                **({"sliding_window": 8} if kind.sliding_window else {}),
                "dtype": STR_DTYPE_TO_TORCH_DTYPE[dtype],
                "kv_quant_mode": get_kv_quant_mode(dtype),
            }
        )
    )
    assert spec == vllms and type(spec) is type(plain)
    data = 64 // 2 if dtype.startswith("int4") else 64
    assert spec.page_size_bytes == 2 * 16 * 2 * (data + 4)
    layout = KVLayout.single_group(1, 3, 16)
    pool = pool_for(layout, [kind], 2, 64, mx.bfloat16, kv_cache_quant(dtype, 1))
    assert pool.nbytes == 3 * spec.page_size_bytes
    assert pool.keys[0].shape == (3, 16, 2, data + 4) and pool.keys[0].dtype == mx.uint8
    assert not np.asarray(pool.keys[0][0]).any()  # the null block: zero rows, scale 0.0


def test_per_token_head_pools_read_layers_of_their_own_shape() -> None:
    """A layer with its own heads and head size reads its region as rows of its own width."""
    kinds = [FULL_ATTENTION, LayerKind(num_kv_heads=1, head_dim=128)]
    quant = kv_cache_quant("int4_per_token_head", 2)
    pool = pool_for(KVLayout.single_group(2, 2, 16), kinds, 2, 64, mx.float32, quant)
    assert pool.stored_shape(2, 64) == (2, 36) and pool.stored_shape(1, 128) == (1, 68)
    assert [k.shape for k in pool.keys] == [(2, 16, 2, 36), (2, 16, 1, 68)]
    assert [q.kv_cache_dtype for q in pool.layer_quant] == ["int4_per_token_head"] * 2


def test_a_hybrids_scales_map_to_its_layers_by_module_name(tmp_path) -> None:
    """Nemotron-H's layers with KV memory skip its MLP-only blocks, Falcon-H1's are two per
    decoder layer: each takes the scales of the decoder layer its module name holds."""
    save_file(
        {
            "backbone.layers.3.mixer.k_scale": np.array(0.5, np.float32),
            "backbone.layers.3.mixer.v_scale": np.array(0.25, np.float32),
            "model.layers.1.self_attn.kv_scale": np.array(2.0, np.float32),
        },
        str(tmp_path / "scales.safetensors"),
    )
    names = ["backbone.layers.0.mixer", "backbone.layers.3.mixer", "backbone.layers.4.mixer"]
    quant = kv_cache_quant("fp8", 3, tmp_path, names)
    assert (quant.k_scales, quant.v_scales) == ((1.0, 0.5, 1.0), (1.0, 0.25, 1.0))
    falcon = [f"model.layers.{i}.{part}" for i in range(2) for part in ("self_attn", "mamba")]
    quant = kv_cache_quant("fp8", 4, tmp_path, falcon)
    assert quant.k_scales == quant.v_scales == (1.0, 1.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="names no decoder layer"):
        kv_cache_quant("fp8", 1, tmp_path, ["lm_head"])
