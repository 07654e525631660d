"""The MLX model runner: turns each `SchedulerOutput` into one packed forward over the paged KV
cache, for every model kind and both ways a step ends.

This module holds only what every model kind shares; keep it that way. What differs by kind
(loading and its checks, KV specs, dummy steps, a step's extra inputs and its forward) is a
`ModelState` (`model_states/`: decoder, multimodal, encoder-only, encoder-decoder), picked from the
model config; how a step ends is an output stage (`output.py`: `Sampling` or `Pooling`), picked by
`runner_type`. A feature the state or the stage does not run is refused at construction, by its
flag. Each concern has its own module beside this one: request state (`request_state`), varlen
packing (`batch`), the forward (`forward`), the async step (`step`), sampling (`sample`), prompt
logprobs (`prompt_logprobs`), dummy steps (`warmup`), speculative decoding (`spec_decode/`), LoRA
(`lora/`), media items (`mm/`), pooling (`pool/`), cross-attention (`speech/`). It meets the
worker's `ModelRunner` protocol (`vllm_metal.backends.protocol`). KV memory lives in
`vllm_metal.kv`, the model behind its adapter in `vllm_metal.models`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from vllm_metal import envs
from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.runner import stages
from vllm_metal.backends.mlx.runner.batch import PackedBatch, pack_batch
from vllm_metal.backends.mlx.runner.kv_connector import ConnectorSteps
from vllm_metal.backends.mlx.runner.lora import make_lora_manager
from vllm_metal.backends.mlx.runner.model_states import FEATURE_FLAGS, ModelState, select
from vllm_metal.backends.mlx.runner.model_states.interface import AuxHidden
from vllm_metal.backends.mlx.runner.output import Forward, output_stage_class
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.self_check import startup_stage
from vllm_metal.backends.mlx.runner.spec_decode.ahead import CarriedDrafts
from vllm_metal.backends.protocol import RunnerMemory
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.kv.state_drafts import StepDrafts
from vllm_metal.kv.turboquant import TurboQuantPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sequence import IntermediateTensors
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds

    from vllm_metal.backends.mlx.runner.output import OutputStage

logger = init_logger(__name__)


class MLXModelRunner:
    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.block_size = vllm_config.cache_config.block_size

        stage = output_stage_class(vllm_config)
        state_class = select(vllm_config)
        refuse_features(vllm_config, state_class, stage)
        self.state: ModelState = state_class(vllm_config, lm_head=stage.lm_head)
        self.states = RequestStates(vllm_config, [self.block_size])
        self.output = stage(vllm_config, self.states, self.state)
        self.spec = self.output.spec
        self.lora = make_lora_manager(vllm_config, self.state.compute_dtype)
        # Pipeline parallelism: a stage before the last ends its steps at hidden states, and
        # learns the sampled tokens from the scheduler (`RequestStates.tokens_from_scheduler`).
        self.last_stage = stages.is_last(vllm_config)
        self.states.tokens_from_scheduler = not self.last_stage

        self.kv_layout: KVLayout | None = None
        self.group_windows: list[int | None] = []  # per KV-cache group (`KVLayout.group_windows`)
        self.kv_pool: KVPool | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        # vLLM's KV connector (KV offloading), set up by the worker before the KV cache.
        self.connector: ConnectorSteps | None = None
        logger.info("Model kind: %s; steps end in %s", self.state.kind, stage.__name__.lower())

    # ------------------------------------------------------------ model

    def load_model(self) -> None:
        start = time.perf_counter()
        with startup_stage(self.vllm_config, "loading it with mlx-lm"):
            described = self.state.load()
        if self.lora is not None:
            self.lora.wrap(self.state.get_model())
        if self.spec is not None:
            self.spec.drafter.load()
        self.output.load(self.state)
        logger.info("Model loading took %.2f s; %s", time.perf_counter() - start, described)

    def get_model(self) -> Any:
        return self.state.get_model()

    def is_loaded(self) -> bool:
        return self.state.is_loaded()

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return self.output.supported_tasks(self.state)

    # ------------------------------------------------------------ memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        assert self.state.is_loaded(), "load the model first"
        specs = self.state.kv_cache_specs(self.block_size)
        if self.spec is not None:  # a draft model's layers take part in vLLM's KV sizing
            specs.update(self.spec.drafter.kv_cache_specs(self.block_size, self.state.kv_dtype))
        return specs

    def memory(self) -> RunnerMemory:
        drafter = None if self.spec is None else self.spec.drafter
        # The LoRA slots are parameters of the wrapped model; its host cache is reserved here.
        return RunnerMemory(
            weights=self.state.weight_bytes()
            + (0 if drafter is None else drafter.weight_bytes)
            + (0 if self.lora is None else self.lora.host_cache_bytes),
            kv_cache=(0 if self.kv_pool is None else self.kv_pool.nbytes)
            + (0 if drafter is None else drafter.kv_bytes),
        )

    def profile_run(self) -> int:
        num_tokens = max(1, min(self.max_num_tokens, self.model_config.max_model_len))
        with startup_stage(self.vllm_config, "the profiling run's dummy prefill"):
            return self.state.profile(num_tokens, self.block_size)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        assert self.state.is_loaded(), "load the model first"
        if not kv_cache_config.kv_cache_groups:
            assert not self.state.uses_kv_cache, "vLLM planned no KV cache for this model"
            self.states.set_block_sizes([])
            logger.info("KV cache: none (%s model)", self.state.kind)
            return
        self.state.bind_kv_cache(kv_cache_config)
        names = self.state.kv_layer_names()
        self.kv_layout = layout = KVLayout.from_config(kv_cache_config, names)
        self.block_size = layout.block_size
        self.kv_cache_config = kv_cache_config
        self.connector = ConnectorSteps.make()
        self.states.set_block_sizes(layout.block_sizes())
        self.group_windows = layout.group_windows(self.state.layer_kinds)
        self._allocate_kv_pool()
        if self.spec is not None:
            self.spec.drafter.initialize_kv_cache(kv_cache_config)
        logger.info(
            "KV cache: %d blocks of %d tokens in %d group(s), %d region(s) (%.1f MiB)",
            layout.num_blocks,
            layout.block_size,
            layout.num_groups,
            layout.num_regions,
            self.kv_pool.nbytes / 2**20,
        )

    def _allocate_kv_pool(self) -> None:
        self.kv_pool = self.state.make_kv_pool(self.kv_layout)
        if self.connector is not None:
            self.connector.bind_pool(self.kv_pool, self.kv_cache_config)

    def warm_up(self) -> None:
        with startup_stage(self.vllm_config, "the warm-up's dummy prefill and decode steps"):
            self.state.warm_up(self.block_size, self.max_num_tokens)

    # ------------------------------------------------------------ the step

    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """A step; under pipeline parallelism a stage after the first starts from the previous
        stage's `intermediate_tensors`, and a stage before the last returns its own."""
        # The previous step's tokens are inputs of this one: sampled now, or left on the
        # device when it drew them there (`step.CarriedTokens`).
        shifts = self.spec is not None and self._shifts_positions()
        carried = self.output.drain(scheduler_output, shifts)
        started = time.perf_counter()
        if self.connector is not None:
            self.connector.start(scheduler_output)
        self._copy_blocks(scheduler_output)
        if self.spec is not None:
            for req_id in scheduler_output.finished_req_ids:
                self.spec.forget(req_id)
            self.spec.restart(scheduler_output)
        proposed = None if self.spec is None else self.spec.proposed()
        if isinstance(carried, CarriedDrafts):  # the scheduler's counts stand, less on the device
            placeholders = carried.placeholders()
            proposed = {**(proposed or {}), **placeholders}
            for req_id in placeholders:
                self.states.computed_after_step.pop(req_id, None)
        self.states.update(scheduler_output, proposed)
        self.output.add_requests(scheduler_output)
        batch = self.states.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            if self.connector is not None:  # transfers go on while nothing is scheduled
                return ModelRunnerOutput.with_kv_conn_output_only(
                    self.connector.finish(scheduler_output)
                )
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert self.kv_pool is not None or not self.state.uses_kv_cache, "KV cache not initialized"

        packed = self._pack(scheduler_output)
        if carried is not None:
            packed = carried.into(packed)
        if self.lora is not None:
            self.lora.prepare(
                batch.request_lora_mapping[: batch.num_reqs],
                batch.lora_id_to_lora_request,
                packed.num_scheduled,
            )
        inputs = self.state.step_inputs(scheduler_output, packed, self.states)
        if packed.num_draft_tokens.any() and any(k.is_state for k in self.state.layer_kinds):
            inputs = replace(
                inputs, drafts=StepDrafts(packed.num_scheduled, packed.num_draft_tokens)
            )
        aux_layers = () if self.spec is None else self.spec.drafter.aux_layer_ids
        if aux_layers:
            inputs = replace(inputs, aux=AuxHidden(aux_layers))
        if intermediate_tensors is not None:
            inputs = replace(
                inputs,
                stage_hidden=stages.from_previous(intermediate_tensors, self.state.compute_dtype),
            )
        traces = self.state.compiled_traces
        hidden = self.state.hidden_states(self.kv_pool, packed, inputs)
        kv_arrays = [] if self.kv_pool is None else self.kv_pool.arrays()
        if inputs.drafts is not None:
            kv_arrays += inputs.drafts.arrays()
        if not self.last_stage:
            return stages.to_next(hidden, kv_arrays)
        forward = Forward(
            scheduler_output,
            packed,
            hidden,
            started,
            kv_arrays,
            self.connector,
            inputs.drafts,
            self.kv_pool,
            None if inputs.aux is None else inputs.aux.states,
            traced=self.state.compiled_traces != traces,
        )
        output = self.output.finish_step(self.state, forward)
        if self.lora is not None:
            self.lora.clear_step()  # the graph holds this step's mask; dummy runs get none
        return output

    def _shifts_positions(self) -> bool:
        """Whether a step's positions may be taken from the device (`PackedBatch.shift`):
        `VLLM_METAL_DRAFTS_AHEAD=1` asks for it (`auto` leaves it off for now: slower on MLX's
        CPU, where the host's work for the next step and the step's own compete for the same
        cores, and in its one reading on the GPU proxy), its decode steps compile, and no
        layer's pages, window or cache reads its lengths on the host (no state layer, sliding
        window, TurboQuant cache or KV connector)."""
        if envs.VLLM_METAL_DRAFTS_AHEAD != "1":
            return False
        step = getattr(self.state, "compiled", None)
        return (
            step is not None
            and step.failed is None
            and self.connector is None
            and not any(kind.is_state for kind in self.state.layer_kinds)
            and not any(self.group_windows)
            and not isinstance(self.kv_pool, TurboQuantPool)
        )

    def _pack(self, scheduler_output: SchedulerOutput) -> PackedBatch:
        """This step's scheduled tokens of the InputBatch as one varlen batch (`batch.py`)."""
        batch = self.states.input_batch
        num_groups = 0 if self.kv_layout is None else self.kv_layout.num_groups
        return pack_batch(
            batch.req_ids,
            self.states.num_scheduled(scheduler_output),
            batch.num_computed_tokens_cpu,
            batch.num_tokens_no_spec,
            batch.token_ids_cpu,
            [batch.block_table[g].get_numpy_array() for g in range(num_groups)],
            self.states.block_sizes,
            None if self.spec is None else self.states.num_draft_tokens(),
            self.group_windows,
        )

    def _copy_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The KV block copies the scheduler asks for before this step."""
        if scheduler_output.kv_cache_block_copies and self.kv_pool is not None:
            copies = scheduler_output.kv_cache_block_copies
            self.kv_pool.copy_blocks(
                [c.src_block_id for c in copies], [c.dst_block_id for c in copies]
            )

    def sample_tokens(
        self, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        return self.output.sample_tokens(grammar_output) or EMPTY_MODEL_RUNNER_OUTPUT

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return None if self.spec is None else self.spec.take()

    # ------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self._lora_manager().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self._lora_manager().pin(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora is None else self.lora.list()

    def _lora_manager(self):
        if self.lora is None:
            raise ValueError("LoRA adapters need --enable-lora")
        return self.lora

    # ------------------------------------------------------------ sleep mode

    def sleep(self, level: int) -> None:
        """Level 1 frees the KV cache; level 2 also frees the weights (reloaded on wake-up).

        CPU and GPU share one memory on Apple Silicon, so there is no host copy to offload
        weights to: level 1 keeps them where they are.
        """
        self.discard(("kv_cache", "weights") if level >= 2 else ("kv_cache",))

    def discard(self, tags: tuple[str, ...]) -> None:
        """Free the memory of the tagged parts; their contents are forgotten."""
        if "kv_cache" in tags:
            self.kv_pool = None
            if self.connector is not None:
                self.connector.release_pool()
        if "weights" in tags:
            self.state.discard_weights()
        if self.spec is not None:
            self.spec.drafter.discard(tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and not self.state.is_loaded():
            self.load_model()
        if "kv_cache" in tags and self.kv_pool is None and self.kv_layout is not None:
            self._allocate_kv_pool()
        if self.spec is not None:
            self.spec.drafter.wake_up(tags)

    def reset_encoder_cache(self) -> None:
        """Forget every encoded media item (vLLM resets its scheduler's record at the same time)."""
        self.state.reset_encoder_cache()

    def shutdown(self) -> None:
        self.discard(("kv_cache", "weights"))


def requested_features(vllm_config: VllmConfig) -> list[str]:
    """The runner features (`FEATURE_FLAGS` keys) the config turns on."""
    transfer = vllm_config.kv_transfer_config
    offloading = getattr(vllm_config.cache_config, "kv_offloading_size", None)
    requested = {
        "lora": vllm_config.lora_config is not None,
        "speculative_decoding": vllm_config.speculative_config is not None,
        "kv_connector": transfer is not None or offloading is not None,
    }
    return [feature for feature, on in requested.items() if on]


def refuse_features(
    vllm_config: VllmConfig, state_class: type[ModelState], stage: type[OutputStage]
) -> None:
    """One rule for every kind and stage: a feature either runs on both, or is refused here by
    its flag (the platform refuses the same earlier, at startup; this is the backstop)."""
    for feature in requested_features(vllm_config):
        runner_type = vllm_config.model_config.runner_type
        parts = ((state_class, f"{state_class.kind} models"), (stage, f"runner={runner_type!r}"))
        for part, name in parts:
            if feature not in part.features:
                raise ValueError(
                    f"{FEATURE_FLAGS[feature]} is not supported with {name} on the MLX "
                    f"runner (model={vllm_config.model_config.model!r}); remove it"
                )
