"""Device facts of the torch backend (`VLLM_METAL_BACKEND=mps`): vLLM's own model classes run on
torch's `mps` device on a Mac with Metal, on the `cpu` device elsewhere."""

from __future__ import annotations

import gc
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


class TorchBackend(PagedKernelFacts):
    name = "mps"

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
