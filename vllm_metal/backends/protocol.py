"""The contracts between the backend-neutral worker and a backend: `Backend` (device facts and
the runner factory) and `ModelRunner` (what the worker calls every step and at each lifecycle
event). Each backend has one runner class for every model kind (`MLXModelRunner`, `TorchRunner`),
and both meet the same `ModelRunner` (tests/backends/test_runner_protocol.py checks signatures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sequence import IntermediateTensors
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput


@dataclass(frozen=True)
class RunnerMemory:
    """Device bytes a runner holds now."""

    weights: int
    kv_cache: int


class ModelRunner(Protocol):
    """What the worker calls on a runner; a runner class has each method with these parameter
    names and kinds. Model kinds and pooling live inside a runner, not in subclasses of it."""

    # -- model and memory
    def load_model(self) -> None: ...
    def get_model(self) -> Any: ...
    def is_loaded(self) -> bool: ...
    def memory(self) -> RunnerMemory: ...
    def profile_run(self) -> int:
        """Peak bytes one full-size step needs beyond the weights."""
        ...

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]: ...
    def get_supported_tasks(self) -> tuple[SupportedTask, ...]: ...
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None: ...
    def warm_up(self) -> None: ...

    # -- the step
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """A step; under pipeline parallelism, from and to the neighbouring stages' hidden
        states (a stage before the last returns its `IntermediateTensors`)."""
        ...

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput: ...
    def take_draft_token_ids(self) -> DraftTokenIds | None: ...

    # -- LoRA adapters (vLLM's worker calls; a runner without LoRA raises ValueError on add)
    def add_lora(self, lora_request: LoRARequest) -> bool: ...
    def remove_lora(self, lora_id: int) -> bool: ...
    def pin_lora(self, lora_id: int) -> bool: ...
    def list_loras(self) -> set[int]: ...

    # -- sleep mode and shutdown ("weights" / "kv_cache" tags as vLLM names them)
    def sleep(self, level: int) -> None: ...
    def wake_up(self, tags: list[str] | None) -> None: ...
    def discard(self, tags: tuple[str, ...]) -> None: ...
    def reset_encoder_cache(self) -> None: ...
    def shutdown(self) -> None: ...


class Backend(Protocol):
    name: str
    # Whether vLLM's async scheduler may drive the runner (the platform turns it off otherwise).
    async_scheduling: bool
    # Whether vLLM's attention layers call the backend through vLLM's custom op.
    opaque_attention_op: bool

    def torch_device_type(self) -> str:
        """The torch device vLLM's tensors live on ('cpu' where MLX owns the accelerator)."""
        ...

    def attention_backend(self) -> str:
        """Qualified name of the vLLM attention backend vLLM's layers use here."""
        ...

    def register_kernel_overrides(self) -> None:
        """Route the Triton kernels vLLM's own runner launches to this backend's versions."""
        ...

    def import_kernels(self) -> None:
        """Load the vLLM compiled ops this backend's layers call, if any."""
        ...

    def configure_hybrid(self, vllm_config: VllmConfig) -> None:
        """Cache settings of a hybrid model's state layers, before vLLM builds its scheduler."""
        ...

    def init_device(self) -> str:
        """Select the compute device; returns its description for the startup log line."""
        ...

    def device_description(self) -> str:
        """E.g. 'MLX gpu': the device the runner computes on (without selecting it)."""
        ...

    def head_sizes(self) -> tuple[int, ...]:
        """Attention head sizes the backend's kernels take."""
        ...

    def block_size_multiple(self) -> int:
        """KV block sizes must be a multiple of this."""
        ...

    def kv_cache_layouts(self) -> list[str]:
        """vLLM layout names the backend's KV pools implement, most preferred first."""
        ...

    def total_memory_bytes(self) -> int: ...
    def active_memory_bytes(self) -> int: ...
    def synchronize(self) -> None: ...
    def release_cached_memory(self) -> None: ...
    def seed(self, seed: int) -> None: ...
    def make_runner(self, vllm_config: VllmConfig) -> ModelRunner: ...
