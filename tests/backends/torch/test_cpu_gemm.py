"""On the cpu device the torch backend gives the model's linear layers vLLM's CPU GEMM dispatch:
the platform loads vLLM's CPU kernels, every unquantized 2-D linear layer and the LM head are
packed once, and their products still equal `F.linear` on the loaded weights."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Runs in a process of its own: which kernels vLLM loads is decided once, when `vllm._custom_ops`
# is first imported under the platform of that process.
SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform

    from vllm_metal.backends.torch.cpu_gemm import pack_linear_layers

    assert type(current_platform).__name__ == "MetalPlatform", current_platform
    assert current_platform.device_type == "cpu"
    assert ops._supports_onednn, "the platform did not load vLLM's CPU kernels"

    def layer(method, out_features, in_features, ndim=2):
        m = torch.nn.Module()
        shape = (out_features, in_features) if ndim == 2 else (out_features, 1, in_features)
        m.weight = torch.nn.Parameter(torch.randn(*shape) * 0.1, requires_grad=False)
        m.quant_method = method
        return m

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv = layer(UnquantizedLinearMethod(), 96, 64)
    model.down = layer(UnquantizedLinearMethod(), 64, 160)
    model.conv = layer(UnquantizedLinearMethod(), 32, 4, ndim=3)
    model.embed = layer(UnquantizedEmbeddingMethod(), 500, 64)
    model.lm_head = layer(UnquantizedEmbeddingMethod(), 500, 64)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}

    assert pack_linear_layers(model) == 3
    for name, rows in (("qkv", 1), ("qkv", 32), ("down", 7), ("lm_head", 32)):
        m = getattr(model, name)
        x = torch.randn(rows, loaded[name + ".weight"].shape[1])
        got = m.quant_method.apply(m, x)
        want = F.linear(x, loaded[name + ".weight"])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Packed linear weights are dropped (the packed copy replaces them); the LM head keeps its
    # table (a tied head is the embedding); the 3-D short-conv weight and a plain embedding stay.
    assert model.qkv.weight.numel() == 0 and model.down.weight.numel() == 0
    assert torch.equal(model.lm_head.weight, loaded["lm_head.weight"])
    assert torch.equal(model.conv.weight, loaded["conv.weight"])
    assert type(model.conv.quant_method) is UnquantizedLinearMethod
    assert type(model.embed.quant_method) is UnquantizedEmbeddingMethod
    assert not hasattr(model.embed, "cpu_linear")
    print("ok")
    """
)


@pytest.mark.skipif(sys.platform == "darwin", reason="the cpu device is the off-Mac device")
def test_linear_layers_take_vllms_cpu_gemm_on_the_cpu_device() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_METAL_BACKEND"] = "mps"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
