"""Where a step's GPU time goes on the GPU proxy: the CUDA kernels MLX's CUDA backend ran during
one call and the CUDA API calls that launched them, recorded by torch's profiler (CUPTI sees
every kernel of the process, MLX's included), per step.

Tells a host-bound step (kernel time well under the step's wall time; the API's graph
instantiation or launches large) from a GPU-bound one, and which kernels weigh. On a machine
without CUDA it returns `{"skipped": why}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TOP = 12  # kernels and API calls listed


def kernel_profile(fn: Callable[[], Any], steps: Callable[[], int]) -> dict[str, Any]:
    """Runs `fn()` under torch's profiler; `steps()` (read after the call) says how many steps
    it ran. Returns ms per step: wall, summed kernel time, kernel launches, the heaviest
    kernels and CUDA API calls (host time)."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError as e:
        return {"skipped": f"no torch profiler: {e}"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device for torch's profiler"}
    torch.cuda.init()
    try:
        return _profiled(fn, steps, profile, ProfilerActivity)
    except (
        RuntimeError,
        AttributeError,
        TypeError,
        ValueError,
        KeyError,
    ) as e:  # a profiler that fails must not cost the engine's other figures
        return {"skipped": f"torch's profiler failed: {e!r}"}


def _profiled(fn: Callable[[], Any], steps: Callable[[], int], profile: Any, activity: Any) -> dict:
    with profile(activities=[activity.CPU, activity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    n = max(1, steps())
    kernels: dict[str, list[float]] = {}  # name -> [us, count]
    api: dict[str, list[float]] = {}
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if "cuda" in str(getattr(e, "device_type", "")).lower() and device_us:
            kernels[e.key] = [device_us, e.count]
        elif e.key.startswith(("cuda", "cu")) and e.cpu_time_total:
            api[e.key] = [e.cpu_time_total, e.count]

    def per_step(table: dict[str, list[float]]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:TOP]
        return [{"name": k[:90], "ms": round(us / 1e3 / n, 4), "calls": round(c / n, 2)}
                for k, (us, c) in rows]  # fmt: skip

    return {
        "steps": n,
        "wall_ms": round(wall * 1e3 / n, 3),
        "kernel_ms": round(sum(us for us, _ in kernels.values()) / 1e3 / n, 3),
        "kernels_per_step": round(sum(c for _, c in kernels.values()) / n, 1),
        "api_ms": round(sum(us for us, _ in api.values()) / 1e3 / n, 3),
        "top_kernels": per_step(kernels),
        "top_api": per_step(api),
    }
