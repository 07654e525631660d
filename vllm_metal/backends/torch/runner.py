"""The torch backend's runner as the worker sees it (`backends.protocol.ModelRunner`): vLLM's V1
runner (`model_runner.TorchModelRunner`) behind the protocol, with memory figures measured on the
torch device."""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

import torch
from vllm.config import set_current_vllm_config

from vllm_metal._logging import init_logger
from vllm_metal.backends.protocol import RunnerMemory
from vllm_metal.backends.torch.device import resident_bytes
from vllm_metal.backends.torch.model_runner import TorchModelRunner

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sequence import IntermediateTensors
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

logger = init_logger(__name__)


def _peak_resident_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class TorchRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.vllm_config = vllm_config
        self.device = device
        with set_current_vllm_config(vllm_config):
            self.runner = TorchModelRunner(vllm_config, device)

    # -- model and memory
    def load_model(self) -> None:
        with set_current_vllm_config(self.vllm_config):
            self.runner.load_model()

    def get_model(self) -> torch.nn.Module:
        return self.runner.get_model()

    def is_loaded(self) -> bool:
        return getattr(self.runner, "model", None) is not None

    def memory(self) -> RunnerMemory:
        model = getattr(self.runner, "model", None)
        weights = 0
        if model is not None:
            weights = _tensor_bytes([*model.parameters(), *model.buffers()])
        return RunnerMemory(weights=weights, kv_cache=_tensor_bytes(self.runner.kv_caches))

    def profile_run(self) -> int:
        """Bytes a full-size step adds: on the cpu device the growth of the resident peak."""
        mps = self.device.type == "mps"
        before = torch.mps.driver_allocated_memory() if mps else resident_bytes()
        with set_current_vllm_config(self.vllm_config):
            self.runner.profile_run()
        if mps:
            torch.mps.synchronize()
            return max(0, int(torch.mps.driver_allocated_memory()) - int(before))
        return max(0, _peak_resident_bytes() - before)

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.runner.get_kv_cache_spec()

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return self.runner.get_supported_tasks()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        with set_current_vllm_config(self.vllm_config):
            self.runner.initialize_kv_cache(kv_cache_config)

    def warm_up(self) -> None:
        return None

    # -- the step
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        return self.runner.execute_model(scheduler_output, intermediate_tensors)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None

    # -- LoRA adapters: refused at startup (config.table); a request naming one is a 400 there.
    def add_lora(self, lora_request) -> bool:
        raise ValueError("vllm-metal (torch backend): LoRA adapters are not supported")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    # -- sleep mode: refused at startup (the capability table)
    def sleep(self, level: int) -> None:
        raise ValueError("vllm-metal (torch backend): sleep mode is not supported")

    def wake_up(self, tags: list[str] | None) -> None:
        raise ValueError("vllm-metal (torch backend): sleep mode is not supported")

    def discard(self, tags: tuple[str, ...]) -> None:
        raise ValueError("vllm-metal (torch backend): releasing the KV cache is not supported")

    def reset_encoder_cache(self) -> None:
        self.runner.reset_encoder_cache()

    def shutdown(self) -> None:
        self.runner.shutdown()
