"""vLLM platform for Apple Silicon: device facts, memory figures and the config checks that decide,
at startup, whether this plugin can serve what was asked."""

from __future__ import annotations

import os
import platform as _pyplatform
import subprocess
import sys
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from vllm_metal import envs
from vllm_metal._logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORKER_QUALNAME = "vllm_metal.worker.MetalWorker"
# The native kernels tile the KV cache in blocks of 8, 16 or 32 tokens; vLLM block sizes that are
# multiples of 8 map onto them.
KERNEL_BLOCK_ALIGN = 8


def _tolerate_missing_torch_accelerator() -> None:
    """vLLM's teardown calls torch.accelerator.empty_cache() on every non-CPU platform; torch
    raises there when it has no accelerator (the MLX runner off-Mac), so make it a no-op then."""
    accel = getattr(torch, "accelerator", None)
    if accel is None or accel.is_available():
        return
    for name in ("empty_cache", "empty_host_cache"):
        if hasattr(accel, name):
            setattr(accel, name, lambda: None)


_tolerate_missing_torch_accelerator()


class MetalConfigError(ValueError):
    """A setting this platform cannot serve; raised at startup with what to change."""


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def chip_name() -> str:
    """Marketing name of the processor: 'Apple M3 Max' on a Mac, the CPU model elsewhere."""
    if sys.platform == "darwin":
        return _sysctl("machdep.cpu.brand_string") or "Apple Silicon"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _pyplatform.processor() or _pyplatform.machine()


def mlx_device_kind() -> str:
    """'gpu' or 'cpu': the MLX device the runner computes on (VLLM_METAL_DEVICE may force it)."""
    import mlx.core as mx

    wanted = envs.VLLM_METAL_DEVICE
    has_gpu = mx.metal.is_available()
    if wanted == "gpu" and not has_gpu:
        raise MetalConfigError("VLLM_METAL_DEVICE=gpu but MLX reports no Metal GPU on this machine")
    if wanted == "cpu" or not has_gpu:
        return "cpu"
    return "gpu"


def total_memory_bytes() -> int:
    """Unified memory on a Mac (what Metal may use), physical RAM elsewhere."""
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.device_info()
        # MLX reports Metal's recommended working set; that is the ceiling for wired buffers.
        for key in ("max_recommended_working_set_size", "memory_size"):
            if info.get(key):
                return int(info[key])
    if sys.platform == "darwin":
        raw = _sysctl("hw.memsize")
        if raw:
            return int(raw)
    import psutil

    return int(psutil.virtual_memory().total)


def available_memory_bytes() -> int:
    """Memory that can still be allocated now (free + reclaimable)."""
    import psutil

    return int(psutil.virtual_memory().available)


class MetalPlatform(Platform):
    _enum = PlatformEnum.OOT
    # vLLM builds torch devices from these names; its tensors (sampler, scheduler I/O) live on
    # the host while MLX owns the accelerator.
    device_name: str = "cpu"
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    dist_backend: str = "gloo"
    device_control_env_var: str = "VLLM_METAL_VISIBLE_DEVICES"
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(SUPPORTED_DTYPES)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        try:
            kind = mlx_device_kind()
        except Exception:
            kind = "unavailable"
        return f"{chip_name()} (MLX {kind})"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return total_memory_bytes()

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        import mlx.core as mx

        return float(mx.get_active_memory())

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        import mlx.core as mx

        mx.random.seed(seed)

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        # Only the experimental torch backend runs vLLM's own attention layers; off-Mac it runs
        # them on the CPU, where vLLM's CPU attention backend is the one that exists.
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        return AttentionBackendEnum.CPU_ATTN.get_path()

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's own compiled ops are not used by the MLX runner; the native extension is
        # loaded by vllm_metal.ops when first needed.
        return None

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        # Requests the MLX runner cannot run become a 400 before they reach the engine.
        from vllm_metal.request_validation import validate_request

        validate_request(processed_inputs, params)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        envs.validate()
        check_config(vllm_config)
        apply_config(vllm_config)


def check_config(vllm_config: VllmConfig) -> None:
    """Refuse, with the setting's name and what to use instead, anything this plugin cannot run."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1:
        raise MetalConfigError(
            f"vllm-metal serves on one device: tensor_parallel_size={parallel.tensor_parallel_size}"
            " is not supported (use --tensor-parallel-size 1)"
        )
    if parallel.pipeline_parallel_size > 1:
        raise MetalConfigError(
            "vllm-metal serves on one device: "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} is not supported"
        )
    if parallel.data_parallel_size > 1:
        raise MetalConfigError(
            f"vllm-metal: data_parallel_size={parallel.data_parallel_size} is not supported"
        )
    model = vllm_config.model_config
    if model is not None:
        if model.dtype not in SUPPORTED_DTYPES:
            raise MetalConfigError(
                f"vllm-metal: dtype={model.dtype} is not supported; use one of "
                "float16, bfloat16, float32 (--dtype)"
            )
        if model.quantization is not None:
            raise MetalConfigError(
                f"vllm-metal: quantization={model.quantization!r} is not supported; serve an "
                "MLX-quantized checkpoint (mlx_lm.convert -q) instead"
            )
        from vllm_metal.ops._checks import HEAD_SIZES

        head_size = model.get_head_size()
        if head_size not in HEAD_SIZES:
            raise MetalConfigError(
                f"vllm-metal: attention head size {head_size} of model={model.model!r} is not "
                f"supported; the paged attention kernels take head sizes {sorted(HEAD_SIZES)}"
            )
        if getattr(model, "use_mla", False):
            raise MetalConfigError("vllm-metal: multi-head latent attention (MLA) models are not supported")
    cache = vllm_config.cache_config
    if cache.cache_dtype not in ("auto", None) and not str(cache.cache_dtype).startswith(
        ("bfloat16", "float16", "float32")
    ):
        raise MetalConfigError(
            f"vllm-metal: kv_cache_dtype={cache.cache_dtype!r} is not supported; use 'auto'"
        )
    if cache.block_size is not None and cache.block_size % KERNEL_BLOCK_ALIGN != 0:
        raise MetalConfigError(
            f"vllm-metal: block_size={cache.block_size} is not supported; use a multiple of "
            f"{KERNEL_BLOCK_ALIGN} (8, 16, 32, 64, 128, ...)"
        )
    if vllm_config.speculative_config is not None:
        raise MetalConfigError("vllm-metal: speculative decoding is not supported yet")
    if vllm_config.lora_config is not None:
        raise MetalConfigError("vllm-metal: LoRA adapters are not supported yet (--enable-lora)")


def apply_config(vllm_config: VllmConfig) -> None:
    """Choose the worker and executor and turn off what only CUDA graphs/torch.compile use."""
    from vllm.config import CompilationMode, CUDAGraphMode

    parallel = vllm_config.parallel_config
    if parallel.worker_cls == "auto":
        parallel.worker_cls = WORKER_QUALNAME
    if parallel.distributed_executor_backend in (None, "auto"):
        parallel.distributed_executor_backend = "uni"
    parallel.disable_custom_all_reduce = True
    if getattr(parallel, "enable_dbo", False):
        parallel.enable_dbo = False

    compilation = vllm_config.compilation_config
    compilation.mode = CompilationMode.NONE
    compilation.cudagraph_mode = CUDAGraphMode.NONE
    compilation.cudagraph_capture_sizes = []
    compilation.max_cudagraph_capture_size = 0

    cache = vllm_config.cache_config
    if not cache.user_specified_block_size:
        cache.block_size = 16

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
