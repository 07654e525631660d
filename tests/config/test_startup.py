"""Proves the startup checks refuse, by name, what a backend does not serve (the capability table
on real vLLM configs) and apply the settings the device needs. Configs are built by vLLM's own
EngineArgs on a tiny checkpoint, with the plugin as the platform."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


def _engine_config(model: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def metal_config(qwen3_dir: Path):
    from vllm.platforms import current_platform

    if type(current_platform).__name__ != "MetalPlatform":
        pytest.fail(f"vLLM chose {type(current_platform).__name__}, not MetalPlatform")
    return _engine_config(qwen3_dir)


def test_apply_config_picks_our_worker_and_turns_off_cuda_only_features(metal_config) -> None:
    from vllm.config import CompilationMode, CUDAGraphMode

    assert metal_config.parallel_config.worker_cls == "vllm_metal.worker.MetalWorker"
    assert metal_config.parallel_config.distributed_executor_backend == "uni"
    assert metal_config.cache_config.block_size == 16
    assert metal_config.compilation_config.mode == CompilationMode.NONE
    assert metal_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert metal_config.model_config.dtype in (torch.bfloat16, torch.float16, torch.float32)


def test_lora_settings_are_accepted(qwen3_dir: Path) -> None:
    config = _engine_config(qwen3_dir, enable_lora=True, max_loras=3, max_lora_rank=32)
    assert (config.lora_config.max_loras, config.lora_config.max_lora_rank) == (3, 32)


def test_data_parallel_replicas_are_served_each_with_its_share_of_memory(qwen3_dir: Path) -> None:
    from vllm_metal.config.startup import MEMORY_SHARE_KEY

    config = _engine_config(qwen3_dir, data_parallel_size=2)
    assert config.parallel_config.data_parallel_size == 2
    assert config.additional_config[MEMORY_SHARE_KEY] == 2  # two replicas on this host
    assert _engine_config(qwen3_dir).additional_config[MEMORY_SHARE_KEY] == 1


def test_pipeline_stages_are_served_each_with_its_share_of_memory(qwen3_dir: Path) -> None:
    from vllm_metal.config.startup import MEMORY_SHARE_KEY

    config = _engine_config(qwen3_dir, pipeline_parallel_size=2)
    assert config.parallel_config.distributed_executor_backend == "mp"  # vLLM's choice, kept
    assert config.additional_config[MEMORY_SHARE_KEY] == 2  # both stages on this host
    # The stages before the last read the sampled tokens the scheduler sends back, which it does
    # only without async scheduling: vLLM turns it off, and refuses it when asked for.
    assert not config.scheduler_config.async_scheduling
    with pytest.raises(ValueError, match="pipeline parallelism with async scheduling"):
        _engine_config(qwen3_dir, pipeline_parallel_size=2, async_scheduling=True)


def test_ray_data_parallel_engines_are_refused_by_their_flag(qwen3_dir: Path) -> None:
    # vLLM refuses "ray" itself while the package is missing (this venv); with it installed the
    # platform's check is what stops it, so the check runs here on a config set afterwards.
    from vllm_metal.config.errors import MetalConfigError
    from vllm_metal.config.startup import refuse_ray
    from vllm_metal.platform import MetalPlatform

    assert MetalPlatform.ray_device_key == "GPU"  # Ray's executor places stages on Ray GPUs
    config = _engine_config(qwen3_dir, data_parallel_size=2)
    refuse_ray(config)  # mp: served
    config.parallel_config.data_parallel_backend = "ray"
    with pytest.raises(MetalConfigError, match="--data-parallel-backend ray is not supported"):
        refuse_ray(config)


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_that_map_onto_the_kernels_are_kept(qwen3_dir: Path, block_size: int) -> None:
    assert _engine_config(qwen3_dir, block_size=block_size).cache_config.block_size == block_size


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"tensor_parallel_size": 2}, ["tensor_parallel_size=2", "all-reduce", "--pipeline"]),
        (
            {"pipeline_parallel_size": 2, "enable_lora": True},
            [
                "pipeline parallelism with LoRA adapters",
                "--enable-lora",
                "--pipeline-parallel-size 1",
            ],
        ),
        (
            {"pipeline_parallel_size": 2, "data_parallel_size": 2},
            ["pipeline parallelism with data parallelism", "data_parallel_size=2"],
        ),
        ({"block_size": 12}, ["block_size=12", "multiple of 8"]),
        ({"kv_cache_dtype": "ultraquant_4bit"}, ["kv_cache_dtype", "ultraquant_4bit"]),
        (
            {
                "kv_cache_dtype": "fp8",
                "speculative_config": {
                    "model": "{model}",
                    "num_speculative_tokens": 2,
                    "kv_cache_dtype": "auto",
                },
            },
            ["kv_cache_dtype='auto' differs from --kv-cache-dtype fp8", "unset"],
        ),
        (
            {
                "speculative_config": {
                    "model": "{model}",
                    "num_speculative_tokens": 2,
                    "kv_cache_dtype": "int4_per_token_head",
                },
            },
            ["kv_cache_dtype='int4_per_token_head' differs from --kv-cache-dtype auto"],
        ),
        ({"quantization": "fp8"}, ["quantization", "fp8"]),
        (
            {
                "speculative_config": {
                    "method": "eagle3",
                    "model": "{model}",
                    "num_speculative_tokens": 2,
                }
            },
            ["--speculative-config method='eagle3'", "'ngram' or 'draft_model'"],
        ),
        (
            {
                "speculative_config": {
                    "model": "{model}",
                    "num_speculative_tokens": 2,
                    "draft_sample_method": "probabilistic",
                }
            },
            ["draft_sample_method='probabilistic'"],
        ),
        (
            {"runner": "pooling", "enable_lora": True},
            ["LoRA adapters with pooling models", "--enable-lora", "remove --enable-lora"],
        ),
        (
            {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
            ["KV connectors", "kv_connector='NixlConnector'", "--kv-offloading-size"],
        ),
        (
            {"runner": "pooling", "kv_offloading_size": 1.0},
            ["KV offloading with pooling models", "kv_offloading_size=1.0", "remove"],
        ),
        (
            {
                "kv_offloading_size": 1.0,
                "speculative_config": {"model": "{model}", "num_speculative_tokens": 2},
            },
            ["KV offloading with a draft model", "method='draft_model'"],
        ),
        ({"kv_offloading_size": 1.0, "kv_offloading_backend": "lmcache"}, ["lmcache"]),
    ],
    ids=[
        "tp",
        "pp_lora",
        "pp_dp",
        "block_size",
        "kv_ultraquant_4bit",
        "kv_fp8_draft_auto",
        "kv_auto_draft_int4_per_token_head",
        "quantization",
        "spec_eagle3",
        "spec_probabilistic",
        "pooling_lora",
        "kv_connector",
        "kv_offload_pooling",
        "kv_offload_draft_model",
        "kv_offload_lmcache",
    ],
)
def test_unsupported_settings_are_refused_by_name(
    metal_config, qwen3_dir: Path, kwargs: dict, names: list[str]
) -> None:
    kwargs = json.loads(json.dumps(kwargs).replace("{model}", str(qwen3_dir)))
    with pytest.raises(ValueError) as info:
        _engine_config(qwen3_dir, **kwargs)
    message = str(info.value)
    assert "vllm-metal" in message
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    "dtype",
    [
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    ],
)
def test_fp8_kv_caches_are_served(metal_config, qwen3_dir: Path, dtype: str) -> None:
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype)
    assert config.cache_config.cache_dtype == dtype
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype, speculative_config=ngram)
    assert config.speculative_config.method == "ngram"
    # A draft model's pages take the target's format (vLLM's draft inherits it).
    draft = {"model": str(qwen3_dir), "num_speculative_tokens": 2}
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype, speculative_config=draft)
    assert config.speculative_config.method == "draft_model"


def test_fp8_scales_of_a_hybrid_checkpoint_are_served(metal_config, tiny_qwen3_next_dir, tmp_path):
    """A hybrid checkpoint's KV scales, named by decoder layer, are mapped to its attention layers
    by their module names (`kv.quant.kv_cache_quant`; tests/kv/test_quant.py)."""
    import shutil

    import numpy as np
    from safetensors.numpy import save_file

    model = tmp_path / "scaled"
    shutil.copytree(tiny_qwen3_next_dir, model)
    scale = {"model.layers.3.self_attn.k_scale": np.array(0.5, dtype=np.float32)}
    save_file(scale, str(model / "kv_scales.safetensors"))
    assert _engine_config(model, kv_cache_dtype="fp8").cache_config.cache_dtype == "fp8"


def test_per_token_head_caches_are_served_with_two_head_sizes(metal_config, tiny_gemma4_dir):
    """Gemma 4's full-attention layers have rows of another head size: with each row's scale
    beside it vLLM pads the narrower layers' pages, which the pools lay out as padded regions
    (tests/kv/test_pool.py; the engine: tests/backends/mlx/runner/test_per_token_head_kv.py)."""
    config = _engine_config(tiny_gemma4_dir, kv_cache_dtype="int4_per_token_head")
    assert config.cache_config.cache_dtype == "int4_per_token_head"


@pytest.mark.parametrize("dtype", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_turboquant_kv_caches_are_served(metal_config, qwen3_dir: Path, dtype: str) -> None:
    from vllm_metal.config.table import refusal

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype, speculative_config=ngram)
    assert config.cache_config.cache_dtype == dtype
    # vLLM keeps the boundary layers (here both of two) at the model's dtype.
    assert config.cache_config.kv_cache_dtype_skip_layers == ["0", "1"]
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype)
    assert refusal(config, "mlx") is None
    # KV offload tiers carry the slots' bytes (tests/backends/mlx/runner/test_turboquant_kv.py).
    offload = _engine_config(qwen3_dir, kv_cache_dtype=dtype, kv_offloading_size=1.0)
    assert offload.cache_config.cache_dtype == dtype
    message = refusal(config, "mps")
    assert f"TurboQuant KV caches with text decoders: --kv-cache-dtype {dtype}" in message
    # A draft model's pages take the format (tests/backends/mlx/runner/test_quant_kv_drafters.py).
    draft = {"model": str(qwen3_dir), "num_speculative_tokens": 2}
    config = _engine_config(qwen3_dir, kv_cache_dtype=dtype, speculative_config=draft)
    assert config.speculative_config.method == "draft_model"


def test_turboquant_refuses_drafters_it_cannot_store(metal_config, qwen3_dir, tiny_model_dir):
    """A draft model whose head size the preset cannot pack, and a speculative method whose pages
    are not built in TurboQuant slots, are refused by name."""
    from vllm_metal.config.errors import MetalConfigError
    from vllm_metal.config.startup import _turboquant_served

    narrow = tiny_model_dir("qwen3", head_dim=48, hidden_size=192, num_heads=4)
    draft = {"model": str(narrow), "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as info:
        _engine_config(qwen3_dir, kv_cache_dtype="turboquant_4bit_nc", speculative_config=draft)
    assert "head size 48 is not a power of two" in str(info.value)
    assert str(narrow) in str(info.value)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    config = _engine_config(qwen3_dir, kv_cache_dtype="turboquant_k8v4", speculative_config=ngram)
    config.speculative_config.method = "suffix"  # served by no kind: reached by none today
    with pytest.raises(MetalConfigError, match="method='suffix'") as info:
        _turboquant_served(config)
    assert "'draft_model'" in str(info.value) and "'eagle3'" in str(info.value)


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2", "int8_per_token_head"])
def test_fp8_kv_caches_are_refused_where_the_table_lacks_them(metal_config, qwen3_dir, dtype):
    from vllm_metal.config.table import refusal

    config = _engine_config(qwen3_dir)
    config.cache_config.cache_dtype = dtype
    assert refusal(config, "mlx") is None
    message = refusal(config, "mps")
    assert f"quantized KV caches with text decoders: --kv-cache-dtype {dtype}" in message


@pytest.mark.parametrize(
    ("method", "asked", "on"),
    [("ngram", None, False), ("draft_model", None, True), ("draft_model", False, False)],
)
def test_speculative_decoding_keeps_the_async_scheduling_vllm_chose(
    metal_config, qwen3_dir: Path, method: str, asked: bool | None, on: bool
) -> None:
    # The runner serves drafts under async scheduling (docs/speculative-decoding.md): vLLM turns
    # it on by default with a draft model (and MTP), off with its host-side n-gram proposer.
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": str(qwen3_dir)})
    config = _engine_config(qwen3_dir, speculative_config=spec, async_scheduling=asked)
    assert config.speculative_config.method == method
    assert config.scheduler_config.async_scheduling is on
    if method == "ngram":  # vLLM refuses it asked for, before the platform sees the config
        with pytest.raises(ValueError, match="async scheduling is only supported"):
            _engine_config(qwen3_dir, speculative_config=spec, async_scheduling=True)


def test_the_default_config_is_a_text_decoder_asking_for_no_feature(metal_config) -> None:
    from vllm_metal.config.features import FEATURES
    from vllm_metal.config.kinds import kind_of

    assert kind_of(metal_config).name == "text"
    assert not [f.name for f in FEATURES if f.requested(metal_config)]


def test_unsupported_dtype_is_refused_by_name(metal_config) -> None:
    # vLLM's CLI only offers dtypes we support, so the check is reached through a config whose
    # dtype was changed after vLLM built it.
    import copy

    from vllm_metal.config import MetalConfigError
    from vllm_metal.config.startup import check_config

    config = copy.deepcopy(metal_config)
    object.__setattr__(config.model_config, "dtype", torch.float64)
    with pytest.raises(MetalConfigError, match=r"dtype=torch\.float64"):
        check_config(config)
    check_config(metal_config)  # the unchanged one passes


def test_head_size_without_a_kernel_is_served_with_a_warning(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head size the Metal kernels lack is not refused: it runs the generic path, said once."""
    from vllm_metal.config import startup as metal_platform

    seen: list[str] = []
    # Recorded at the call: vLLM's logging setup may reset the handlers of its logger tree.
    monkeypatch.setattr(metal_platform.logger, "warning", lambda msg, *a: seen.append(msg % a))
    _engine_config(tiny_model_dir("qwen3", head_dim=48, hidden_size=192, num_heads=4))
    assert any("head size 48" in m and "generic path" in m for m in seen), seen
    seen.clear()
    _engine_config(tiny_model_dir("qwen3"))  # a kernel head size: nothing to say
    assert not any("head size" in m for m in seen), seen


def test_mla_models_are_not_warned_of_their_head_size(
    tiny_minicpm3_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM reports MiniCPM3's rotary head size (16 here), but its layers attend over latent rows
    through the MLA op, which takes any width."""
    from vllm_metal.config import startup as metal_platform

    seen: list[str] = []
    monkeypatch.setattr(metal_platform.logger, "warning", lambda msg, *a: seen.append(msg % a))
    config = _engine_config(tiny_minicpm3_dir)
    assert config.model_config.get_head_size() == 16
    assert not any("head size" in m for m in seen), seen


def test_turboquant_is_served_where_windowed_and_full_layers_share_memory(tiny_model_dir):
    """Gemma 3 (sliding and full layers): vLLM overlays their KV-cache groups in one region,
    where the boundary layers' float pages and the others' slots share it, padded to one size
    (tests/backends/mlx/runner/test_turboquant_mixed.py)."""
    config = _engine_config(tiny_model_dir("gemma3"), kv_cache_dtype="turboquant_k8v4")
    assert config.cache_config.cache_dtype == "turboquant_k8v4"


def test_turboquant_is_refused_where_images_attend_both_ways(tiny_idefics3_dir):
    """Idefics3, whose images are attended causally, is served
    (tests/backends/mlx/runner/test_vision_quant_kv.py); a prefix-LM model taking images (Gemma 3
    and 4: vLLM's `is_mm_prefix_lm`, as vLLM reads it from Gemma 3's config in
    tests/models/test_language_model_only.py; Gemma 3's processor does not load here) is refused:
    one image's tokens attend to each other both ways, which TurboQuant's read of the slots does
    not take. Serving it text-only (`language_model_only`) takes no images."""
    from vllm_metal.config.errors import MetalConfigError
    from vllm_metal.config.startup import _turboquant_served

    config = _engine_config(tiny_idefics3_dir, kv_cache_dtype="turboquant_k8v4")
    assert config.cache_config.cache_dtype == "turboquant_k8v4"
    config.model_config.__dict__["is_mm_prefix_lm"] = True  # vLLM's cached_property, as read
    with pytest.raises(MetalConfigError) as info:
        _turboquant_served(config)
    assert "prefix-LM model taking media" in str(info.value)
    assert "--kv-cache-dtype turboquant_k8v4" in str(info.value)
    config.model_config.multimodal_config.language_model_only = True
    assert _turboquant_served(config)
