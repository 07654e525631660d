"""Device facts of the torch backend (`VLLM_METAL_BACKEND=mps`): vLLM's own model classes run on
torch's `mps` device on a Mac with Metal, on the `cpu` device elsewhere."""

from __future__ import annotations

import gc
import importlib
import sys
from typing import TYPE_CHECKING

import torch

from vllm_metal.backends.kernel_facts import PagedKernelFacts
from vllm_metal.host import physical_memory_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_metal.backends.protocol import ModelRunner


def device_type() -> str:
    """'mps' where torch has a Metal device (macOS), else 'cpu'."""
    if sys.platform == "darwin" and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resident_bytes() -> int:
    """Resident memory of this process: what torch's CPU device holds, with everything else."""
    import psutil

    return int(psutil.Process().memory_info().rss)


# The attention backend vLLM's layers use on this backend (`attention.py`).
ATTENTION_BACKEND = "vllm_metal.backends.torch.attention.MetalPagedAttentionBackend"


class TorchBackend(PagedKernelFacts):
    name = "mps"
    # vLLM's V1 runner here runs without async scheduling.
    async_scheduling = False
    # It runs eagerly: its attention layers call the backend directly rather than through vLLM's
    # custom op (registered for one dispatch key).
    opaque_attention_op = False

    def torch_device_type(self) -> str:
        return device_type()

    def attention_backend(self) -> str:
        # Importing it registers its name with vLLM's backend enum in this process.
        importlib.import_module(ATTENTION_BACKEND.rsplit(".", 1)[0])
        return ATTENTION_BACKEND

    def register_kernel_overrides(self) -> None:
        from vllm_metal.backends.torch.model_runner import register_kernel_overrides

        register_kernel_overrides()

    def import_kernels(self) -> None:
        # On `mps` the layers use none of vLLM's compiled ops; on the cpu device they take vLLM's
        # CPU GEMMs (`cpu_gemm.py`), so vLLM's CPU kernels load the way its CPU platform loads them.
        if device_type() == "cpu":
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.import_kernels()

    def configure_hybrid(self, vllm_config: VllmConfig) -> None:
        # vLLM's runner keeps the state pages; vLLM sizes the blocks for them.
        from vllm_metal.backends.torch import short_conv

        short_conv.configure(vllm_config)

    def init_device(self) -> str:
        return self.device_description()

    def device_description(self) -> str:
        return f"torch {device_type()}"

    def torch_device(self) -> torch.device:
        return torch.device(device_type())

    def total_memory_bytes(self) -> int:
        """Metal's recommended working set on a Mac, physical RAM elsewhere."""
        if device_type() == "mps":
            return int(torch.mps.recommended_max_memory())
        return physical_memory_bytes()

    def active_memory_bytes(self) -> int:
        if device_type() == "mps":
            return int(torch.mps.current_allocated_memory())
        return resident_bytes()

    def synchronize(self) -> None:
        if device_type() == "mps":
            torch.mps.synchronize()

    def release_cached_memory(self) -> None:
        gc.collect()
        if device_type() == "mps":
            torch.mps.empty_cache()

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def make_runner(self, vllm_config: VllmConfig) -> ModelRunner:
        from vllm_metal.backends.torch.runner import TorchRunner

        return TorchRunner(vllm_config, self.torch_device())


TORCH_BACKEND = TorchBackend()
