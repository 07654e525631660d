"""vLLM v1 worker for Apple Silicon: backend-neutral device lifecycle, memory sizing and sleep.

The backend (`VLLM_METAL_BACKEND`, `vllm_metal.backends`) supplies the device facts and the model
runner; this class answers vLLM's engine and talks to the runner only through its protocol
(`vllm_metal.backends.protocol.ModelRunner`). It imports no backend library.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.utils.mem_utils import format_gib
from vllm.v1.outputs import AsyncModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from vllm_metal._logging import init_logger
from vllm_metal.backends import get_backend
from vllm_metal.host import available_memory_bytes, chip_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    from vllm_metal.backends.protocol import ModelRunner

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
        # vLLM inspects model classes in the engine process too (its multimodal budget asks the
        # registry before the scheduler starts); a spawned engine process has not run
        # `pre_register_and_update`, so the classes vLLM should see are registered here as well.
        from vllm_metal.compat import vllm_models

        vllm_models.install()
        self.backend = get_backend()
        self.model_runner: ModelRunner | None = None
        # vLLM's multiprocessing executor reads a step's async output on a thread of its own
        # while the next step runs on the main thread; the runner's steps are not thread-safe.
        self._step_lock = threading.RLock()

    # --------------------------------------------------------------- device

    def init_device(self) -> None:
        device = self.backend.init_device()
        logger.info("vllm-metal: backend %s, %s on %s", self.backend.name, device, chip_name())
        self.device = torch.device("cpu")  # vLLM's host-side tensors

        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank, "gloo"
        )
        self._seed()
        self.model_runner = self.backend.make_runner(self.vllm_config)

    def _seed(self) -> None:
        seed = self.model_config.seed
        if seed is not None:
            from vllm.utils.torch_utils import set_random_seed

            set_random_seed(seed)
            self.backend.seed(seed)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        if load_dummy_weights:
            raise ValueError("vllm-metal: load_format='dummy' is not supported")
        self.model_runner.load_model()

    def get_model(self) -> Any:
        return self.model_runner.get_model()

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return self.model_runner.get_supported_tasks()

    # --------------------------------------------------------------- memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.model_runner.get_kv_cache_spec()

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return self.backend.kv_cache_layouts()

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: the utilization budget minus weights and the activation peak."""
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            logger.info("KV cache: %s GiB requested explicitly", format_gib(explicit))
            return int(explicit)
        # Only the budgeted path needs the activation peak; the full-size dummy step it takes
        # costs seconds on a CPU.
        activation_peak = self.model_runner.profile_run()
        weights = self.model_runner.memory().weights
        utilization = self.cache_config.gpu_memory_utilization
        total = self.backend.total_memory_bytes()
        replicas = memory_share(self.vllm_config)
        budget = int(total * utilization) // replicas
        free_now = available_memory_bytes()
        kv_bytes = min(
            budget - weights - activation_peak, free_now - activation_peak - HEADROOM_BYTES
        )
        per_request = self._one_request_kv_bytes()
        logger.info(
            "Memory: %s GiB total, budget %s GiB (utilization %.2f, %d process(es) on this "
            "host), weights %s GiB, activation peak %s GiB, free now %s GiB -> KV cache %s GiB",
            format_gib(total),
            format_gib(budget),
            utilization,
            replicas,
            format_gib(weights),
            format_gib(activation_peak),
            format_gib(free_now),
            format_gib(max(kv_bytes, 0)),
        )
        if kv_bytes < per_request:
            raise ValueError(
                f"Not enough memory for one request of max_model_len="
                f"{self.model_config.max_model_len}: it needs {format_gib(per_request)} GiB of KV "
                f"cache but only {format_gib(max(kv_bytes, 0))} GiB is left after the weights "
                f"({format_gib(weights)} GiB) and activations within "
                f"gpu_memory_utilization={utilization} of {format_gib(total)} GiB. Lower "
                "--max-model-len, raise --gpu-memory-utilization, or set --kv-cache-memory-bytes."
            )
        return int(kv_bytes)

    def _one_request_kv_bytes(self) -> int:
        # vLLM's own per-spec figure: a sliding-window layer holds only its window's blocks.
        specs = self.get_kv_cache_spec().values()
        return sum(spec.max_memory_usage_bytes(self.vllm_config) for spec in specs)

    def get_cache_block_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.get_kv_cache_spec().values())

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        # vLLM's KV connector (KV offloading) exists before the cache it copies from.
        from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized

        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.model_runner.warm_up()
        logger.info("Warm-up took %.2f s", time.perf_counter() - start)
        self._seed()  # warm-up must not shift the seeded streams
        return CompilationTimes(language_model=0.0, encoder=0.0)

    # ----------------------------------------------------------------- step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        with self._step_lock:
            if self.parallel_config.pipeline_parallel_size == 1:
                return self.model_runner.execute_model(scheduler_output)
            return self._execute_stage(scheduler_output)

    def _execute_stage(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """A pipeline stage's step: after the first, it starts from the hidden states the
        previous stage sends; before the last, it sends its own on and returns nothing (vLLM
        takes the step's output from the last stage)."""
        from vllm.distributed.parallel_state import get_pp_group
        from vllm.sequence import IntermediateTensors

        pipeline = get_pp_group()
        received = None
        if scheduler_output.total_num_scheduled_tokens > 0 and not pipeline.is_first_rank:
            received = IntermediateTensors(pipeline.recv_tensor_dict())
        output = self.model_runner.execute_model(scheduler_output, received)
        if isinstance(output, IntermediateTensors):
            pipeline.send_tensor_dict(output.tensors)
            return None
        return output

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        with self._step_lock:
            output = self.model_runner.sample_tokens(grammar_output)
        if isinstance(output, AsyncModelRunnerOutput):
            return _LockedOutput(output, self._step_lock)
        return output

    def execute_dummy_batch(self) -> None:
        # vLLM's DP engine steps an idle replica of a mixture-of-experts model with a dummy batch
        # so that the replicas' collectives inside the model line up; the MLX runner has none.
        return None

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.model_runner.take_draft_token_ids()

    def get_kv_connector_handshake_metadata(self) -> dict | None:
        # KV offloading is local to this worker: there is no peer to hand-shake with.
        return None

    def check_health(self) -> None:
        if self.model_runner is None or not self.model_runner.is_loaded():
            raise RuntimeError("vllm-metal worker has no model loaded")

    def synchronize_device(self) -> None:
        self.backend.synchronize()

    # ----------------------------------------------------------- sleep mode

    def sleep(self, level: int = 1) -> None:
        before = self.backend.active_memory_bytes()
        self.model_runner.sleep(level)
        self.backend.release_cached_memory()
        freed = before - self.backend.active_memory_bytes()
        logger.info("Sleep level %d: freed %s GiB", level, format_gib(freed))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.model_runner.wake_up(tags)

    def discard(self, tags: tuple[str, ...]) -> None:
        """Free the tagged memory (`/release_kv_cache_memory` discards "kv_cache")."""
        before = self.backend.active_memory_bytes()
        self.model_runner.discard(tuple(tags))
        self.backend.release_cached_memory()
        freed = before - self.backend.active_memory_bytes()
        logger.info("Discarded %s: freed %s GiB", ", ".join(tags), format_gib(freed))

    def reset_encoder_cache(self) -> None:
        self.model_runner.reset_encoder_cache()

    def memory_usage(self) -> dict[str, int]:
        """Device memory now (for diagnostics and tests through collective_rpc)."""
        held = self.model_runner.memory()
        return {
            "active": self.backend.active_memory_bytes(),
            "kv_cache": held.kv_cache,
            "weights": held.weights,
        }

    # ------------------------------------------------------------ adapters

    def add_lora(self, lora_request) -> bool:
        return self.model_runner.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.model_runner.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.model_runner.list_loras()

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        if self.model_runner is not None:
            self.model_runner.shutdown()
        self.backend.release_cached_memory()


class _LockedOutput(AsyncModelRunnerOutput):
    """An async step output read under the worker's step lock (see `MetalWorker.__init__`)."""

    def __init__(self, output: AsyncModelRunnerOutput, lock: threading.RLock):
        self._output = output
        self._lock = lock

    def get_output(self) -> ModelRunnerOutput:
        with self._lock:
            return self._output.get_output()


def memory_share(vllm_config: VllmConfig) -> int:
    """How many engine processes on this host share its memory budget: the data-parallel
    replicas started here (`config.startup` records it before vLLM makes each replica a DP=1
    engine); pipeline stages on one host load only their layers and split it the same way."""
    from vllm_metal.config.startup import MEMORY_SHARE_KEY

    recorded = vllm_config.additional_config
    if isinstance(recorded, dict):
        return max(1, int(recorded.get(MEMORY_SHARE_KEY, 1)))
    return 1
