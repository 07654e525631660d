"""vLLM v1 worker for Apple Silicon: owns the MLX device, memory sizing and lifecycle.

The per-request state and the step live in the model runner (`vllm_metal.runner`); this class
answers vLLM's engine (device init, model load, KV sizing, execute/sample, health, shutdown).
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import torch
from vllm.utils.mem_utils import format_gib
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.platform import (
    available_memory_bytes,
    chip_name,
    mlx_device_kind,
    total_memory_bytes,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import ModelRunnerOutput

logger = init_logger(__name__)

# Memory kept free beyond vLLM's utilization budget for the OS, the engine process and
# allocator slack (unified memory is shared with everything else on a Mac).
HEADROOM_BYTES = 512 * 2**20


class MetalWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ):
        super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        self.model_runner = None
        self._activation_peak = 0

    # --------------------------------------------------------------- device

    def init_device(self) -> None:
        import mlx.core as mx

        if envs.VLLM_METAL_BACKEND != "mlx":
            raise ValueError(
                f"VLLM_METAL_BACKEND={envs.VLLM_METAL_BACKEND!r}: only the 'mlx' backend is "
                "available in this build"
            )
        kind = mlx_device_kind()
        mx.set_default_device(mx.gpu if kind == "gpu" else mx.cpu)
        logger.info("vllm-metal: MLX device %s on %s", kind, chip_name())
        self.device = torch.device("cpu")

        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )
        seed = self.model_config.seed
        if seed is not None:
            from vllm.utils.torch_utils import set_random_seed

            set_random_seed(seed)
            mx.random.seed(seed)

        from vllm_metal.runner.model_runner import MLXModelRunner

        self.model_runner = MLXModelRunner(self.vllm_config)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-metal: load_format='dummy' is not supported")
        self.model_runner.load_model()

    def get_model(self):
        return self.model_runner.model

    # --------------------------------------------------------------- memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the utilization budget minus weights and the activation peak."""
        runner = self.model_runner
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            logger.info("KV cache: %s GiB requested explicitly", format_gib(explicit))
            return int(explicit)
        # Only the budgeted path needs the activation peak; the full-size dummy step it takes
        # costs seconds on MLX's CPU backend.
        self._activation_peak = runner.profile_run()

        total = total_memory_bytes()
        budget = int(total * self.cache_config.gpu_memory_utilization)
        used = runner.weight_bytes + self._activation_peak
        by_budget = budget - used
        free_now = available_memory_bytes()
        by_free = free_now - self._activation_peak - HEADROOM_BYTES
        kv_bytes = min(by_budget, by_free)
        blocks_per_request = -(-self.model_config.max_model_len // runner.block_size)
        per_request = runner.kv_bytes_per_block() * blocks_per_request
        logger.info(
            "Memory: %s GiB total, budget %s GiB (utilization %.2f), weights %s GiB, "
            "activation peak %s GiB, free now %s GiB -> KV cache %s GiB",
            format_gib(total),
            format_gib(budget),
            self.cache_config.gpu_memory_utilization,
            format_gib(runner.weight_bytes),
            format_gib(self._activation_peak),
            format_gib(free_now),
            format_gib(max(kv_bytes, 0)),
        )
        if kv_bytes < per_request:
            raise ValueError(
                f"Not enough memory for one request of max_model_len="
                f"{self.model_config.max_model_len}: it needs {format_gib(per_request)} GiB of KV "
                f"cache but only {format_gib(max(kv_bytes, 0))} GiB is left after the weights "
                f"({format_gib(runner.weight_bytes)} GiB) and activations within "
                f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} of "
                f"{format_gib(total)} GiB. Lower --max-model-len, raise "
                "--gpu-memory-utilization, or set --kv-cache-memory-bytes."
            )
        return int(kv_bytes)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def get_cache_block_size_bytes(self) -> int:
        return self.model_runner.kv_bytes_per_block()

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.model_runner.warm_up()
        logger.info("Warm-up took %.2f s", time.perf_counter() - start)
        seed = self.model_config.seed
        if seed is not None:
            from vllm.utils.torch_utils import set_random_seed

            set_random_seed(seed)
        return CompilationTimes(language_model=0.0, encoder=0.0)

    # ----------------------------------------------------------------- step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def execute_dummy_batch(self) -> None:
        return None

    def take_draft_token_ids(self):
        return None

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return ("generate",)

    def check_health(self) -> None:
        if self.model_runner is None or self.model_runner.model is None:
            raise RuntimeError("vllm-metal worker has no model loaded")

    def synchronize_device(self) -> None:
        import mlx.core as mx

        mx.synchronize()

    # ----------------------------------------------------------- sleep mode

    def sleep(self, level: int = 1) -> None:
        import mlx.core as mx

        before = mx.get_active_memory()
        self.model_runner.sleep(level)
        logger.info(
            "Sleep level %d: freed %s GiB", level, format_gib(before - mx.get_active_memory())
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.model_runner.wake_up(tags)

    def reset_encoder_cache(self) -> None:
        # Text-only models keep no encoder outputs between steps.
        return None

    def memory_usage(self) -> dict[str, int]:
        """MLX memory now (for diagnostics and tests through collective_rpc)."""
        import mlx.core as mx

        runner = self.model_runner
        return {
            "active": int(mx.get_active_memory()),
            "kv_cache": runner.kv_pool.nbytes if runner.kv_pool is not None else 0,
            "weights": runner.weight_bytes if runner.model is not None else 0,
        }

    # ------------------------------------------------------------ adapters

    def add_lora(self, lora_request) -> bool:
        raise ValueError("vllm-metal: LoRA adapters are not supported yet")

    def remove_lora(self, lora_id: int) -> bool:
        return False

    def pin_lora(self, lora_id: int) -> bool:
        return False

    def list_loras(self) -> set[int]:
        return set()

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        import mlx.core as mx

        if self.model_runner is not None:
            self.model_runner.kv_pool = None
            self.model_runner.model = None
        gc.collect()
        mx.clear_cache()
