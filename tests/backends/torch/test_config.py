"""What the torch backend (VLLM_METAL_BACKEND=mps) sets up while vLLM builds its config, and what it
refuses there, by the setting's name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_metal import envs


@pytest.fixture
def torch_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*envs.ENV_VARS, "VLLM_TARGET_DEVICE"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_METAL_BACKEND", "mps")
    return monkeypatch


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def test_a_dense_model_is_served_eagerly_on_the_paged_backend(torch_env, tiny_model_dir):
    from vllm.platforms import current_platform

    config = _engine_config(tiny_model_dir("qwen3"), async_scheduling=True)
    assert config.parallel_config.worker_cls == "vllm_metal.worker.MetalWorker"
    assert config.scheduler_config.async_scheduling is False
    assert config.cache_config.block_size == 16
    assert not current_platform.opaque_attention_op()
    path = current_platform.get_attn_backend_cls(None, None)
    assert path == "vllm_metal.backends.torch.attention.MetalPagedAttentionBackend"

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # vLLM resolves the backend by its name: the import registered it.
    assert AttentionBackendEnum["METAL_PAGED"].get_path() == path


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"enable_lora": True}, ["LoRA adapters", "--enable-lora"]),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            ["speculative decoding", "--speculative-config method='ngram'"],
        ),
        ({"enable_sleep_mode": True}, ["sleep mode", "--enable-sleep-mode"]),
        ({"runner": "pooling"}, ["pooling models", "runner='pooling'"]),
        ({"kv_offloading_size": 1.0}, ["KV offloading", "kv_offloading_size=1.0"]),
    ],
    ids=["lora", "speculative", "sleep", "pooling", "kv_offload"],
)
def test_what_the_torch_backend_lacks_is_refused_by_name(torch_env, tiny_model_dir, kwargs, names):
    with pytest.raises(ValueError) as info:
        _engine_config(tiny_model_dir("qwen3"), **kwargs)
    message = str(info.value)
    assert "vllm-metal (mps backend)" in message
    for name in names:
        assert name in message


def test_mlx_quantized_checkpoints_are_refused(torch_env, tiny_quantized_dir):
    with pytest.raises(ValueError, match=r"MLX-quantized checkpoints .*4 bits.*VLLM_METAL_BACKEND"):
        _engine_config(tiny_quantized_dir("qwen3"))


def test_mixture_of_experts_models_are_refused(torch_env, tmp_path):
    from tests.fixtures.tiny_moe import write_tiny_moe

    model = write_tiny_moe(tmp_path / "moe", "qwen3_moe")
    with pytest.raises(
        ValueError, match=r"mixture-of-experts models: .*qwen3_moe.*VLLM_METAL_BACKEND"
    ):
        _engine_config(model)


def test_the_device_is_cpu_off_the_mac():
    from vllm_metal.backends import get_backend

    backend = get_backend("mps")
    assert backend.device_description() == "torch cpu"
    assert backend.torch_device() == torch.device("cpu")
    assert backend.kv_cache_layouts() == ["LBNHC"]


def test_lfm2_keeps_one_window_per_request(torch_env, tiny_lfm2_dir):
    """Short-convolution hybrids are served here; vLLM's "align" mode (a window per cached block)
    would copy states with Triton kernels, so prefix caching is turned off instead."""
    config = _engine_config(tiny_lfm2_dir, enable_prefix_caching=True)
    cache = config.cache_config
    assert config.model_config.is_hybrid
    assert cache.enable_prefix_caching is False
    assert cache.mamba_cache_mode == "none"
    assert cache.mamba_block_size == config.model_config.max_model_len


def test_lfm2_window_dtypes_other_than_the_model_dtype_are_refused(torch_env, tiny_lfm2_dir):
    with pytest.raises(ValueError, match=r"--mamba-cache-dtype float16 .*model dtype \(float32\)"):
        _engine_config(tiny_lfm2_dir, dtype="float32", mamba_cache_dtype="float16")


def test_lfm2_on_the_mlx_backend_keeps_its_windows_in_attention_blocks(torch_env, tiny_lfm2_dir):
    """The MLX backend serves LFM2 too (`models/families/lfm2.py`), with prefix caching: a
    window per cached block, in the bytes of the attention blocks ("align" mode)."""
    torch_env.setenv("VLLM_METAL_BACKEND", "mlx")
    config = _engine_config(tiny_lfm2_dir, enable_prefix_caching=True)
    cache = config.cache_config
    assert cache.enable_prefix_caching
    assert cache.mamba_cache_mode == "align"
    assert cache.mamba_block_size == cache.block_size


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_other_hybrids_stay_refused_here(torch_env, request, family):
    # Qwen3.5 resolves to the plugin's classes (compat.vllm_models), which the torch backend
    # cannot build: the table refuses it first, by name.
    model = request.getfixturevalue(f"tiny_{family}_dir")
    with pytest.raises(ValueError) as info:
        _engine_config(model)
    assert "vllm-metal (mps backend) does not serve hybrid models with" in str(info.value)
    assert f"({family}, " in str(info.value)
