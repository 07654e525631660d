"""Proves that vLLM picks MetalPlatform when it should and that the platform reports true device
facts (its startup checks: tests/config/test_startup.py).

Configs are built by vLLM's own EngineArgs on a tiny checkpoint; platform choice and CLI checks run
in fresh subprocesses, the way `vllm serve` starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    from vllm_metal.config import MetalConfigError
    from vllm_metal.config.startup import selected_backend
    from vllm_metal.platform import MetalPlatform

    clean_env.setenv("VLLM_METAL_DEVICE", "gpu")
    with pytest.raises(ValueError, match="VLLM_METAL_DEVICE"):
        mlx_device_kind()
    with pytest.raises(MetalConfigError, match="VLLM_METAL_DEVICE"):
        selected_backend()
    assert "unavailable" in MetalPlatform.get_device_name()


def test_an_mlx_gpu_without_metal_is_the_device(clean_env: pytest.MonkeyPatch) -> None:
    """MLX's CUDA backend counts as a GPU: the runner computes there in the model's dtype, and
    the ops leave the native extension (built for Metal and the CPU) for their pure-MLX path."""
    import mlx.core as mx

    from vllm_metal.backends.mlx import device
    from vllm_metal.ops import _backend

    clean_env.setattr(mx.metal, "is_available", lambda: False)
    clean_env.setattr(mx.cuda, "is_available", lambda: True)
    assert device.gpu_api() == "cuda"
    assert device.device_kind() == "gpu"
    assert device.compute_dtype(mx.bfloat16) == mx.bfloat16
    assert device.MLX_BACKEND.device_description() == "MLX gpu (cuda)"
    clean_env.setenv("VLLM_METAL_DEVICE", "cpu")
    assert device.device_kind() == "cpu"
    if _backend.loaded_native() is not None and not _backend.loaded_native().HAS_METAL:
        assert _backend.native() is not None
        clean_env.setattr(mx, "default_device", lambda: mx.gpu)
        assert _backend.native() is None


def test_current_memory_usage_follows_mlx_allocations() -> None:
    import mlx.core as mx

    from vllm_metal.platform import MetalPlatform

    before = MetalPlatform.get_current_memory_usage()
    block = mx.zeros((8, 1024, 1024), dtype=mx.float32)  # 32 MiB
    mx.eval(block)
    grown = MetalPlatform.get_current_memory_usage() - before
    assert grown >= 32 * 2**20
    del block


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


# --- the CLI ----------------------------------------------------------------------------------


def test_vllm_version_and_serve_help() -> None:
    """The installed vLLM is the one the plugin pins, and its command line starts with the
    plugin installed (one process: each start of the CLI imports all of vLLM)."""
    from importlib.metadata import version

    assert version("vllm").split("+")[0] == "0.32.0"  # "+cpu": the Linux CPU wheel
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
