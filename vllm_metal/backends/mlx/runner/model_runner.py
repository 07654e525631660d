"""The MLX model runner: turns each `SchedulerOutput` into one packed forward over the paged KV
cache and samples with vLLM's own `Sampler`.

It meets the worker's `ModelRunner` protocol (`vllm_metal.backends.protocol`). Each concern has
its own module beside this one: request state (`request_state`), varlen packing (`batch`), the
forward (`forward`), the async step (`step`), sampling and write-back (`sample`), prompt logprobs
(`prompt_logprobs`), profiling and warm-up (`warmup`), speculative decoding (`spec_decode/`), LoRA
adapters (`lora/`), images and other media items (`mm/`); the runner of pooling models extends it in `pool/`. KV memory lives in
`vllm_metal.kv`, the model behind its adapter in `vllm_metal.models`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.sample.sampler import Sampler

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.device import compute_dtype, dense_on_this_device
from vllm_metal.backends.mlx.dtypes import to_mlx_dtype
from vllm_metal.backends.mlx.runner.batch import PackedBatch, pack_batch
from vllm_metal.backends.mlx.runner.forward import forward
from vllm_metal.backends.mlx.runner.kv_connector import ConnectorSteps
from vllm_metal.backends.mlx.runner.lora import make_lora_manager
from vllm_metal.backends.mlx.runner.mm.embeddings import EncoderCache
from vllm_metal.backends.mlx.runner.mm.mrope import step_positions
from vllm_metal.backends.mlx.runner.mm.profile import encoder_peak
from vllm_metal.backends.mlx.runner.mm.spans import step_key_ends
from vllm_metal.backends.mlx.runner.prompt_logprobs import prompt_logprob_rows
from vllm_metal.backends.mlx.runner.request_state import RequestStates
from vllm_metal.backends.mlx.runner.sample import sample_step
from vllm_metal.backends.mlx.runner.spec_decode import make_spec_decoder
from vllm_metal.backends.mlx.runner.step import StepPipeline, StepState
from vllm_metal.backends.mlx.runner.warmup import DummyRuns
from vllm_metal.backends.protocol import RunnerMemory
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.kv.spec import kv_cache_specs
from vllm_metal.models import LayerKind, ModelAdapter, load_model
from vllm_metal.models.multimodal import MultimodalAdapter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import AsyncModelRunnerOutput, DraftTokenIds

logger = init_logger(__name__)


class MLXModelRunner:
    # Steps end in logits and sampling; the pooling runner (`pool/`) ends them at the hidden
    # states and loads the model without its LM head.
    produces_logits = True

    def __init__(self, vllm_config: VllmConfig):
        self.vllm_config = vllm_config
        self.model_config = model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        scheduler = vllm_config.scheduler_config

        self.kv_dtype = model_config.dtype  # what vLLM sized the cache for
        self.mlx_kv_dtype = to_mlx_dtype(self.kv_dtype)
        self.max_num_tokens = scheduler.max_num_batched_tokens
        self.block_size = vllm_config.cache_config.block_size
        self.num_layers = model_config.get_num_layers(parallel)
        self.num_kv_heads = model_config.get_num_kv_heads(parallel)
        self.head_dim = model_config.get_head_size()

        self.states = RequestStates(vllm_config, [self.block_size])
        self.sampler = Sampler(logprobs_mode=model_config.logprobs_mode)
        self.pipeline = StepPipeline(self._sample, bool(scheduler.async_scheduling))
        self.spec = make_spec_decoder(
            vllm_config,
            self.sampler,
            compute_dtype=compute_dtype(self.mlx_kv_dtype),
            kv_dtype=self.mlx_kv_dtype,
            dequantize=dense_on_this_device(),
        )
        self.lora = make_lora_manager(vllm_config, compute_dtype(self.mlx_kv_dtype))

        self.adapter: ModelAdapter | None = None
        self.layer_kinds: list[LayerKind] = []  # read from the adapter once per load
        self.kv_layout: KVLayout | None = None
        self.kv_pool: KVPool | None = None
        self.kv_cache_config: KVCacheConfig | None = None
        # vLLM's KV connector (KV offloading), set up by the worker before the KV cache.
        self.connector: ConnectorSteps | None = None
        # Encoder outputs of media items, for a model with towers (`mm/`).
        self.encoder_cache: EncoderCache | None = None

    # ------------------------------------------------------------ model

    def load_model(self) -> None:
        start = time.perf_counter()
        load_config = self.vllm_config.load_config
        self.adapter = adapter = load_model(
            self.model_config.model,
            compute_dtype=compute_dtype(self.mlx_kv_dtype),
            dequantize=dense_on_this_device(),
            revision=self.model_config.revision,
            download_dir=load_config.download_dir,
            trust_remote_code=self.model_config.trust_remote_code,
            lm_head=self.produces_logits,
            hf_config=self.model_config.hf_config.to_dict(),  # what a GGUF file is built from
        )
        if adapter.num_layers != self.num_layers:
            raise ValueError(
                f"model={self.model_config.model!r}: the MLX model has {adapter.num_layers} "
                f"layers but the config says {self.num_layers}"
            )
        self.layer_kinds = kinds = adapter.layer_kinds()
        if isinstance(adapter, MultimodalAdapter) and self.encoder_cache is None:
            self.encoder_cache = EncoderCache()
        if self.lora is not None:
            self.lora.wrap(adapter.model)
        if self.spec is not None:
            self.spec.drafter.load()
        logger.info(
            "Model loading took %.2f s; layers: %s",
            time.perf_counter() - start,
            _summarize(kind.label for kind in kinds),
        )

    def get_model(self) -> Any:
        return None if self.adapter is None else self.adapter.model

    def is_loaded(self) -> bool:
        return self.adapter is not None

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return ("generate",)

    # ------------------------------------------------------------ memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        assert self.adapter is not None, "load the model first"
        specs = kv_cache_specs(
            self.adapter.attention_layer_names,
            self.layer_kinds,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            cache_config=self.vllm_config.cache_config,
        )
        if self.spec is not None:  # a draft model's layers take part in vLLM's KV sizing
            specs.update(self.spec.drafter.kv_cache_specs(self.block_size, self.kv_dtype))
        return specs

    def memory(self) -> RunnerMemory:
        drafter = None if self.spec is None else self.spec.drafter
        # The LoRA slots are parameters of the wrapped model; its host cache is reserved here.
        return RunnerMemory(
            weights=(0 if self.adapter is None else self.adapter.weight_bytes)
            + (0 if drafter is None else drafter.weight_bytes)
            + (0 if self.lora is None else self.lora.host_cache_bytes),
            kv_cache=(0 if self.kv_pool is None else self.kv_pool.nbytes)
            + (0 if drafter is None else drafter.kv_bytes),
        )

    def profile_run(self) -> int:
        num_tokens = max(1, min(self.max_num_tokens, self.model_config.max_model_len))
        peak = self._dummy_runs().profile(num_tokens, self.block_size)
        if self.encoder_cache is not None:  # a step encodes images before the decoder runs
            peak += encoder_peak(self.vllm_config, self.adapter)
        return peak

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        assert self.adapter is not None, "load the model first"
        self.kv_layout = layout = KVLayout.from_config(kv_cache_config, self._kv_layer_names())
        self.block_size = layout.block_size
        self.kv_cache_config = kv_cache_config
        self.connector = ConnectorSteps.make()
        self.states.set_block_sizes(layout.block_sizes())
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

    def _kv_layer_names(self) -> list[str]:
        """The layers with KV memory in the pool, in the order of the pool's regions."""
        return self.adapter.attention_layer_names

    def _allocate_kv_pool(self) -> None:
        self.kv_pool = KVPool(
            self.kv_layout,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_kv_dtype,
            latent=any(kind.latent for kind in self.layer_kinds),
        )
        if self.connector is not None:
            self.connector.bind_pool(self.kv_pool, self.kv_cache_config)

    def warm_up(self) -> None:
        self._dummy_runs().warm_up(self.block_size, self.max_num_tokens)

    def _dummy_runs(self) -> DummyRuns:
        assert self.adapter is not None, "load the model first"
        return DummyRuns(
            self.adapter,
            self.layer_kinds,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_kv_dtype,
            self.model_config.get_vocab_size(),
            logits=self.produces_logits,
        )

    # ------------------------------------------------------------ the step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        self.pipeline.drain()  # the previous step's tokens are inputs of this one
        started = time.perf_counter()
        if self.connector is not None:
            self.connector.start(scheduler_output)
        self._copy_blocks(scheduler_output)
        if self.spec is not None:
            for req_id in scheduler_output.finished_req_ids:
                self.spec.forget(req_id)
            self.spec.restart(scheduler_output)
        self.states.update(scheduler_output)
        batch = self.states.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            if self.connector is not None:  # transfers go on while nothing is scheduled
                return ModelRunnerOutput.with_kv_conn_output_only(
                    self.connector.finish(scheduler_output)
                )
            return EMPTY_MODEL_RUNNER_OUTPUT
        assert self.kv_pool is not None, "KV cache not initialized"

        packed = self._pack(scheduler_output)
        prompt_rows = prompt_logprob_rows(self.states, packed)
        if self.lora is not None:
            self.lora.prepare(
                batch.request_lora_mapping[: batch.num_reqs],
                batch.lora_id_to_lora_request,
                packed.num_scheduled,
            )
        logits, prompt_logits = self._forward(scheduler_output, packed, prompt_rows)
        if self.lora is not None:
            self.lora.clear_step()  # the graph holds this step's mask; dummy runs get none
        # Evaluating the cache writes with the logits keeps every step's graph self-contained.
        mx.async_eval(logits, *prompt_logits.values(), *self.kv_pool.arrays())
        self.pipeline.executed = StepState(
            scheduler_output,
            packed,
            logits,
            prompt_logits,
            started=started,
            kv_connector_output=(
                None if self.connector is None else self.connector.finish(scheduler_output)
            ),
        )
        return None

    def _forward(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, prompt_rows
    ) -> tuple[mx.array, dict[str, mx.array]]:
        """The step's lazy logits (`forward.forward`), with the images this step reaches; the
        speech runner adds its encoder."""
        mm_rows = positions = key_ends = None
        if self.encoder_cache is not None:
            requests = self.states.requests
            self.encoder_cache.update(scheduler_output, requests, self.adapter)
            mm_rows = self.encoder_cache.step_rows(packed, requests)
            if self.adapter.uses_mrope:
                positions = step_positions(packed, requests, self.adapter)
            if self.adapter.bidirectional_media:
                key_ends = step_key_ends(packed, requests)
        return forward(
            self.adapter,
            self.kv_pool,
            self.layer_kinds,
            packed,
            prompt_rows,
            mm_rows,
            positions,
            key_ends,
        )

    def _pack(self, scheduler_output: SchedulerOutput) -> PackedBatch:
        """This step's scheduled tokens of the InputBatch as one varlen batch (`batch.py`)."""
        batch = self.states.input_batch
        num_groups = 0 if self.kv_layout is None else self.kv_layout.num_groups
        return pack_batch(
            batch.req_ids,
            scheduler_output.num_scheduled_tokens,
            batch.num_computed_tokens_cpu,
            batch.num_tokens_no_spec,
            batch.token_ids_cpu,
            [batch.block_table[g].get_numpy_array() for g in range(num_groups)],
            self.states.block_sizes,
            None if self.spec is None else self.states.num_draft_tokens(),
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
        return self.pipeline.hand_out(grammar_output) or EMPTY_MODEL_RUNNER_OUTPUT

    def _sample(self, step: StepState) -> ModelRunnerOutput:
        spec = self.spec
        output = sample_step(
            step,
            self.states,
            self.sampler,
            self.model_config.logprobs_mode,
            None if spec is None else spec.rejection_sampler,
        )
        if spec is not None:
            spec.after_step(step, self.states, output.sampled_token_ids)
        output.kv_connector_output = step.kv_connector_output
        return output

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
            self.adapter = None
        if self.spec is not None:
            self.spec.drafter.discard(tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and self.adapter is None:
            self.load_model()
        if "kv_cache" in tags and self.kv_pool is None and self.kv_layout is not None:
            self._allocate_kv_pool()
        if self.spec is not None:
            self.spec.drafter.wake_up(tags)

    def reset_encoder_cache(self) -> None:
        """Forget every encoded media item (vLLM resets its scheduler's record at the same time)."""
        if self.encoder_cache is not None:
            self.encoder_cache.clear()

    def shutdown(self) -> None:
        self.discard(("kv_cache", "weights"))


def _summarize(labels) -> str:
    """'full x 4, sliding(32) x 2' in first-seen order."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} x {n}" for label, n in counts.items())
