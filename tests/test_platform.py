"""Proves that vLLM picks MetalPlatform when it should, and that the platform reports true device
facts and refuses, by name, the settings it cannot serve.

Configs are built by vLLM's own EngineArgs on a tiny checkpoint; platform choice and CLI checks run
in fresh subprocesses, the way `vllm serve` starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vllm_metal
from vllm_metal import envs

VENV_BIN = Path(sys.executable).parent
PLATFORM_SNIPPET = (
    "from vllm.platforms import current_platform as p; print('PLATFORM=' + type(p).__name__)"
)


def _clean_env(**overrides: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith("VLLM_METAL_") or k == "VLLM_TARGET_DEVICE")
    }
    env.update(overrides)
    return env


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        check=False,
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*envs.ENV_VARS, "VLLM_TARGET_DEVICE"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- activation -------------------------------------------------------------------------------


def test_activates_here(clean_env: pytest.MonkeyPatch) -> None:
    active, reason = vllm_metal.activation_reason()
    assert active, reason
    assert vllm_metal.register() == "vllm_metal.platform.MetalPlatform"


def test_disable_wins(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VLLM_METAL_DISABLE", "1")
    active, reason = vllm_metal.activation_reason()
    assert not active
    assert "VLLM_METAL_DISABLE" in reason
    assert vllm_metal.register() is None


def test_target_device_cpu_leaves_the_cpu_platform_to_vllm(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VLLM_TARGET_DEVICE", "cpu")
    active, reason = vllm_metal.activation_reason()
    assert not active
    assert "VLLM_TARGET_DEVICE" in reason
    assert vllm_metal.register() is None


def test_without_mlx_it_stays_out(clean_env: pytest.MonkeyPatch) -> None:
    # None in sys.modules is how Python spells "this module cannot be imported".
    clean_env.setitem(sys.modules, "mlx", None)
    active, reason = vllm_metal.activation_reason()
    assert not active
    assert "MLX" in reason
    assert vllm_metal.register() is None


def test_activation_still_works_once_the_platform_module_is_imported(
    clean_env: pytest.MonkeyPatch,
) -> None:
    # Importing vllm_metal.platform binds the name `platform` in the package namespace; the
    # activation code must not mistake it for the standard library module.
    import vllm_metal.platform

    active, reason = vllm_metal.activation_reason()
    assert active, reason
    assert vllm_metal.register() == "vllm_metal.platform.MetalPlatform"


def test_register_never_raises_on_a_bad_value(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("VLLM_METAL_DISABLE", "perhaps")
    with pytest.raises(ValueError, match="VLLM_METAL_DISABLE"):
        vllm_metal.activation_reason()
    assert vllm_metal.register() is None


@pytest.mark.parametrize(
    "env, expected, first",
    [
        ({}, "MetalPlatform", ""),
        # A process (e.g. vLLM's engine core unpickling its config) may import our modules
        # before it resolves the platform.
        ({}, "MetalPlatform", "import vllm_metal.platform; "),
        ({"VLLM_TARGET_DEVICE": "cpu"}, "CpuPlatform", ""),
        ({"VLLM_METAL_DISABLE": "1"}, "CpuPlatform", ""),
    ],
    ids=["default", "platform-module-first", "target-cpu", "disabled"],
)
def test_vllm_current_platform(env: dict[str, str], expected: str, first: str) -> None:
    if expected == "CpuPlatform" and sys.platform == "darwin":
        pytest.skip("vLLM's CPU platform on macOS is not what this checks")
    proc = _run([sys.executable, "-c", first + PLATFORM_SNIPPET], **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLATFORM=")]
    assert lines == [f"PLATFORM={expected}"], proc.stdout[-2000:]


# --- device facts -----------------------------------------------------------------------------


def _proc_meminfo_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.mark.skipif(sys.platform != "linux", reason="compares with /proc/meminfo")
def test_total_memory_is_the_machine_ram() -> None:
    from vllm_metal.host import available_memory_bytes
    from vllm_metal.platform import MetalPlatform

    total = MetalPlatform.get_device_total_memory()
    assert total == _proc_meminfo_total()
    assert 0 < available_memory_bytes() <= total


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS memory figures")
def test_total_memory_is_at_most_the_unified_memory() -> None:
    from vllm_metal.platform import MetalPlatform

    memsize = int(subprocess.check_output(["sysctl", "-n", "hw.memsize"], text=True))
    assert 0.4 * memsize < MetalPlatform.get_device_total_memory() <= memsize


def _cpu_model_name() -> str:
    if sys.platform == "darwin":
        return subprocess.check_output(
            ["sysctl", "-n", "machdep.cpu.brand_string"], text=True
        ).strip()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    pytest.skip("no model name in /proc/cpuinfo")


def test_device_name_has_the_chip_and_the_mlx_device(clean_env: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    from vllm_metal.platform import MetalPlatform

    name = MetalPlatform.get_device_name()
    assert _cpu_model_name() in name
    kind = "gpu" if mx.metal.is_available() else "cpu"
    assert f"MLX {kind}" in name
    clean_env.setenv("VLLM_METAL_DEVICE", "cpu")
    assert "MLX cpu" in MetalPlatform.get_device_name()


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac has a Metal GPU")
def test_forcing_a_missing_gpu_is_refused(clean_env: pytest.MonkeyPatch) -> None:
    from vllm_metal.backends.mlx.device import device_kind as mlx_device_kind
    from vllm_metal.platform import MetalConfigError, MetalPlatform

    clean_env.setenv("VLLM_METAL_DEVICE", "gpu")
    with pytest.raises(MetalConfigError, match="VLLM_METAL_DEVICE"):
        mlx_device_kind()
    assert "unavailable" in MetalPlatform.get_device_name()


def test_current_memory_usage_follows_mlx_allocations() -> None:
    import mlx.core as mx

    from vllm_metal.platform import MetalPlatform

    before = MetalPlatform.get_current_memory_usage()
    block = mx.zeros((8, 1024, 1024), dtype=mx.float32)  # 32 MiB
    mx.eval(block)
    grown = MetalPlatform.get_current_memory_usage() - before
    assert grown >= 32 * 2**20
    del block


# --- config checks ----------------------------------------------------------------------------


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


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes_that_map_onto_the_kernels_are_kept(qwen3_dir: Path, block_size: int) -> None:
    assert _engine_config(qwen3_dir, block_size=block_size).cache_config.block_size == block_size


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"tensor_parallel_size": 2}, ["tensor_parallel_size=2"]),
        ({"pipeline_parallel_size": 2}, ["pipeline_parallel_size=2"]),
        ({"data_parallel_size": 2}, ["data_parallel_size=2"]),
        ({"block_size": 12}, ["block_size=12", "multiple of 8"]),
        ({"kv_cache_dtype": "fp8"}, ["kv_cache_dtype", "fp8"]),
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
            ["LoRA adapters on pooling models", "--enable-lora"],
        ),
        (
            {"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
            ["KV connectors", "kv_connector='NixlConnector'", "--kv-offloading-size"],
        ),
        (
            {"runner": "pooling", "kv_offloading_size": 1.0},
            ["KV offloading for pooling models", "kv_offloading_size=1.0 with runner='pooling'"],
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
        "pp",
        "dp",
        "block_size",
        "kv_cache_dtype",
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


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_is_served_with_async_scheduling_off(
    metal_config, qwen3_dir: Path, method: str
) -> None:
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": str(qwen3_dir)})
    # vLLM itself refuses async scheduling asked for with ngram, and allows it with a draft model.
    asked = True if method == "draft_model" else None
    config = _engine_config(qwen3_dir, speculative_config=spec, async_scheduling=asked)
    assert config.speculative_config.method == method
    assert config.scheduler_config.async_scheduling is False


def test_every_capability_row_is_checked_for_every_backend(metal_config) -> None:
    from vllm_metal.backends import BACKENDS
    from vllm_metal.capabilities import CAPABILITIES, SUPPORTED

    assert set(SUPPORTED) == set(BACKENDS)
    keys = [cap.key for cap in CAPABILITIES]
    assert len(keys) == len(set(keys))
    for supported in SUPPORTED.values():
        assert supported <= set(keys)
    # The default config asks for none of them.
    assert not [cap.key for cap in CAPABILITIES if cap.requested(metal_config)]


def test_unsupported_dtype_is_refused_by_name(metal_config) -> None:
    # vLLM's CLI only offers dtypes we support, so the check is reached through a config whose
    # dtype was changed after vLLM built it.
    import copy

    from vllm_metal.platform import MetalConfigError, check_config

    config = copy.deepcopy(metal_config)
    object.__setattr__(config.model_config, "dtype", torch.float64)
    with pytest.raises(MetalConfigError, match=r"dtype=torch\.float64"):
        check_config(config)
    check_config(metal_config)  # the unchanged one passes


def test_head_size_without_a_kernel_is_served_with_a_warning(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head size the Metal kernels lack is not refused: it runs the generic path, said once."""
    from vllm_metal import platform as metal_platform

    seen: list[str] = []
    # Recorded at the call: vLLM's logging setup may reset the handlers of its logger tree.
    monkeypatch.setattr(metal_platform.logger, "warning", lambda msg, *a: seen.append(msg % a))
    _engine_config(tiny_model_dir("qwen3", head_dim=48, hidden_size=192, num_heads=4))
    assert any("head size 48" in m and "generic path" in m for m in seen), seen
    seen.clear()
    _engine_config(tiny_model_dir("qwen3"))  # a kernel head size: nothing to say
    assert not any("head size" in m for m in seen), seen


# --- the CLI ----------------------------------------------------------------------------------


def test_vllm_version_and_serve_help() -> None:
    version = _run([str(VENV_BIN / "vllm"), "--version"])
    assert version.returncode == 0, version.stderr[-3000:]
    assert "0.32.0" in version.stdout
    serve = _run([str(VENV_BIN / "vllm"), "serve", "--help"])
    assert serve.returncode == 0, serve.stderr[-3000:]
    assert "usage: vllm serve" in serve.stdout and "ModelConfig" in serve.stdout


@pytest.mark.parametrize(
    "extra_env", [{}, {"VLLM_METAL_DISABLE": "1"}], ids=["plugin-active", "plugin-disabled"]
)
def test_vllm_knows_our_environment_variables(qwen3_dir: Path, extra_env: dict) -> None:
    # EngineArgs(fail_on_environ_validation=True) turns vLLM's "Unknown vLLM environment
    # variable" warning into an error; every VLLM_METAL_* name set here must be known to it.
    env = {name: var.default for name, var in envs.ENV_VARS.items()}
    env.update(extra_env)
    code = (
        "from vllm.engine.arg_utils import EngineArgs\n"
        f"EngineArgs(model={str(qwen3_dir)!r}, max_model_len=256,"
        " fail_on_environ_validation=True).create_engine_config()\n"
        "print('CONFIG_OK')\n"
    )
    proc = _run([sys.executable, "-c", code], **env)
    assert "Unknown vLLM environment variable" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 0 and "CONFIG_OK" in proc.stdout, proc.stderr[-3000:]
