"""The torch backend's rotary layer: vLLM builds it for its plain RotaryEmbedding, and the fused
kernel rotates query and key in place exactly as vLLM's torch-native forward does."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def metal_rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_metal.backends.torch import rotary

    had = op_registry_oot.get("RotaryEmbedding")
    rotary.register()
    with set_current_vllm_config(VllmConfig()):
        yield
    if had is None:
        op_registry_oot.pop("RotaryEmbedding", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("is_neox", "partial"), [(True, 1.0), (False, 1.0), (True, 0.5)])
def test_fused_rotation_equals_vllm_native_forward(metal_rope, dtype, is_neox, partial):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from vllm_metal.backends.torch.rotary import MetalRotaryEmbedding

    head, hq, hkv, tokens = 64, 4, 2, 37
    rope = get_rope(
        head,
        max_position=4096,
        is_neox_style=is_neox,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
        },
        dtype=dtype,
    )
    assert rope.rotary_dim == int(head * partial)
    assert isinstance(rope, MetalRotaryEmbedding)
    gen = torch.Generator().manual_seed(0)
    # Query and key are views of one fused QKV projection, as the attention layers split it.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head, generator=gen).to(dtype)
    query, key, value = qkv.split([hq * head, hkv * head, hkv * head], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)

    value = value.clone()
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = rope.forward_oot(positions, query, key)
    assert got_q.data_ptr() == query.data_ptr()  # in place
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    # The value part of the fused buffer is untouched.
    assert torch.equal(qkv[:, (hq + hkv) * head :], value)
