"""Every environment variable the plugin reads, parsed in one place.

Values are read when accessed (``envs.VLLM_METAL_BACKEND``), so tests and subprocesses that set
them late still see them; a value is parsed again only when its text changed, so the ops may read
one on every call. The names are registered with vLLM so it does not warn about them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(name: str, default: bool) -> Callable[[], bool]:
    def parse() -> bool:
        raw = os.environ.get(name)
        if raw is None:
            return default
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, yes/no or on/off")

    return parse


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def parse() -> str:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            return default
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"{name}={raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


def _cpu_blas(name: str) -> Callable[[], str]:
    def parse() -> str:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            return "auto"
        value = raw.strip()
        if value.lower() in ("auto", "reference"):
            return value.lower()
        if os.path.isabs(value):
            return value
        raise ValueError(
            f"{name}={raw!r} is not auto, reference or an absolute path to a BLAS library"
        )

    return parse


def _threads(name: str) -> Callable[[], int | str]:
    def parse() -> int | str:
        raw = os.environ.get(name)
        if raw is None or raw.strip().lower() in ("", "auto"):
            return "auto"
        try:
            value = int(raw.strip())
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{name}={raw!r} is not a positive number of threads (or auto)")
        return value

    return parse


def _path(name: str) -> Callable[[], str | None]:
    def parse() -> str | None:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            return None
        return os.path.abspath(os.path.expanduser(raw.strip()))

    return parse


_SIZE_UNITS = {"": 2**30, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _size(name: str, default: str) -> Callable[[], int]:
    """A byte size: plain numbers are GiB; K/M/G/T suffixes (optionally with B or iB) are
    binary units."""

    def parse() -> int:
        raw = os.environ.get(name)
        text = (default if raw is None or raw.strip() == "" else raw).strip().lower()
        number = text.removesuffix("ib").removesuffix("b")
        unit = number[-1:] if number[-1:] in _SIZE_UNITS else ""
        try:
            value = float(number.removesuffix(unit) if unit else number)
        except ValueError:
            value = -1.0
        if value <= 0:
            raise ValueError(
                f"{name}={raw!r} is not a positive size; use e.g. 64 (GiB), 512M or 2T"
            )
        return int(value * _SIZE_UNITS[unit])

    return parse


@dataclass(frozen=True)
class EnvVar:
    parse: Callable[[], Any]
    default: str
    help: str


ENV_VARS: dict[str, EnvVar] = {
    "VLLM_METAL_DISABLE": EnvVar(
        _bool("VLLM_METAL_DISABLE", False),
        "0",
        "1 keeps the plugin from activating, so vLLM falls back to its own platform detection.",
    ),
    "VLLM_METAL_BACKEND": EnvVar(
        _choice("VLLM_METAL_BACKEND", "mlx", ("mlx", "mps")),
        "mlx",
        "Compute backend: `mlx` (mlx-lm models on MLX, the default) or `mps`, the torch backend: "
        "vLLM's own model classes on torch's `mps` device on a Mac, `cpu` elsewhere "
        "([torch-backend.md](torch-backend.md)). What each serves: [models.md](models.md).",
    ),
    "VLLM_METAL_DEVICE": EnvVar(
        _choice("VLLM_METAL_DEVICE", "auto", ("auto", "gpu", "cpu")),
        "auto",
        "MLX device: `auto` picks MLX's GPU when it has one (Metal; CUDA too, where the ops run "
        "their pure-MLX versions and a CUDA decode kernel: [gpu-proxy.md](gpu-proxy.md)), else "
        "the CPU.",
    ),
    "VLLM_METAL_USE_REFERENCE_OPS": EnvVar(
        _bool("VLLM_METAL_USE_REFERENCE_OPS", False),
        "0",
        "1 runs the paged attention and cache write through their pure-MLX versions (one batched "
        "graph per call) instead of the native extension (or, on MLX's CUDA GPU, the CUDA decode "
        "kernel).",
    ),
    "VLLM_METAL_DISABLE_GQA_DECODE": EnvVar(
        _bool("VLLM_METAL_DISABLE_GQA_DECODE", False),
        "0",
        "1 turns off the GQA decode kernels (one threadgroup per KV head); the per-token decode "
        "kernel is used instead.",
    ),
    "VLLM_METAL_DISABLE_NAX": EnvVar(
        _bool("VLLM_METAL_DISABLE_NAX", False),
        "0",
        "1 turns off the NAX (Metal 4 tensor op) prefill kernel on M5-class GPUs.",
    ),
    "VLLM_METAL_COMPILE": EnvVar(
        _choice("VLLM_METAL_COMPILE", "auto", ("auto", "1", "0")),
        "auto",
        "Decode steps through one `mx.compile`d forward, traced once per batch-size bucket "
        "([model-runner.md](model-runner.md#compiled-decode)): `auto` on MLX's GPU, not on its "
        "CPU; `1` on every device; `0` never (every step eager).",
    ),
    "VLLM_METAL_DRAFTS_AHEAD": EnvVar(
        _choice("VLLM_METAL_DRAFTS_AHEAD", "auto", ("auto", "1", "0")),
        "auto",
        "Under speculative decoding with compiled decode steps, build a step that verifies "
        "drafts while the one before it still runs, its tokens, drafts and positions taken on "
        "the device ([speculative-decoding.md](speculative-decoding.md#under-async-scheduling)): "
        "`auto` on no device for now (it ran slower on MLX's CPU and in its one reading on the "
        "GPU proxy, docs/benchmarks); `1` on every device; `0` never.",
    ),
    "VLLM_METAL_CPU_BLAS": EnvVar(
        _cpu_blas("VLLM_METAL_CPU_BLAS"),
        "auto",
        "BLAS for MLX's CPU matmuls off the Mac: `auto` loads Intel MKL from the `mkl` package "
        "(Linux x86_64), `reference` keeps the slow reference BLAS bundled with MLX's Linux "
        "wheel, an absolute path loads that library (it must export `cblas_sgemm`). No effect on "
        "macOS arm64 (Accelerate).",
    ),
    "VLLM_METAL_CPU_THREADS": EnvVar(
        _threads("VLLM_METAL_CPU_THREADS"),
        "auto",
        "Threads of that BLAS: `auto` uses as many as the CPUs the process may run on "
        "(`os.sched_getaffinity`), or a positive number.",
    ),
    "VLLM_METAL_SPEC_BACKOFF": EnvVar(
        _bool("VLLM_METAL_SPEC_BACKOFF", True),
        "1",
        "Speculative decoding: 1 drafts only where it is measured to pay (per batch size, the "
        "token rate of decode steps with and without drafts; per request, a minimum share of its "
        "drafts accepted, else a pause); 0 drafts for every request up to its cap, as vLLM's "
        "other backends do.",
    ),
    "VLLM_METAL_SSD_CACHE_DIR": EnvVar(
        _path("VLLM_METAL_SSD_CACHE_DIR"),
        "",
        "A directory for the disk tier of the KV offload: blocks stored to the host tier are "
        "also written here and read back on a prefix hit, also after a restart. Unset: no disk "
        "tier. Without --kv-offloading-size it also turns on a host tier sized from free "
        "memory (docs/kv-offload.md).",
    ),
    "VLLM_METAL_SSD_CACHE_SIZE": EnvVar(
        _size("VLLM_METAL_SSD_CACHE_SIZE", "64"),
        "64",
        "Most bytes the disk tier keeps (least recently used blocks are deleted beyond it): a "
        "number of GiB, or with a K/M/G/T suffix. Refused at startup when the disk has less "
        "free space.",
    ),
}


# name -> (the text it was parsed from, its value)
_parsed: dict[str, tuple[str | None, Any]] = {}


def __getattr__(name: str) -> Any:
    var = ENV_VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raw = os.environ.get(name)
    seen = _parsed.get(name)
    if seen is not None and seen[0] == raw:
        return seen[1]
    value = var.parse()
    _parsed[name] = (raw, value)
    return value


def __dir__() -> list[str]:
    return sorted(ENV_VARS)


def validate() -> None:
    """Parse every variable that is set, so a bad value fails at startup with its name."""
    for name, var in ENV_VARS.items():
        if name in os.environ:
            var.parse()


def register_with_vllm() -> None:
    """Declare the variables to vLLM, which warns about VLLM_* names it does not know.

    vLLM runs this (the `vllm.general_plugins` entry point) in every process once it builds an
    engine, when its logging is set up, so it also logs which CPU BLAS MLX uses here.
    """
    import vllm.envs as vllm_envs

    for name, var in ENV_VARS.items():
        vllm_envs.environment_variables.setdefault(name, var.parse)
    from vllm_metal.backends.mlx import blas

    blas.report()
