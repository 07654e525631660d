"""The runner of pooling models (`--runner pooling`): embeddings, classification and scoring.

It extends the generating runner and keeps its request state, packing and, for decoders, the
paged KV cache (chunked prefill and prefix caching work as for generation). A step ends at the
hidden states instead of logits: they go to vLLM's own pooler (`heads.py`) on the host, and the
step returns each finished request's pooled tensor in `ModelRunnerOutput.pooler_output`
(`None` for a request still prefilling), with no sampling step.

Encoder-only models (BERT, XLM-RoBERTa) attend bidirectionally over whole prompts: vLLM
schedules each prompt in one piece and sizes no KV cache for them (an empty KV-cache spec), and
the step runs the encoder over the packed prompts (`vllm_metal.models.encoder`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import torch
from vllm.tasks import POOLING_TASKS
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.pool.late_interaction_runner import LateInteractionRunner

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.runner.batch import PackedBatch
from vllm_metal.backends.mlx.runner.forward import hidden_states
from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner
from vllm_metal.backends.mlx.runner.pool.heads import (
    build_pooler,
    decoder_classifier,
    is_classifier,
)
from vllm_metal.backends.mlx.runner.tensors import to_torch
from vllm_metal.backends.mlx.runner.warmup import activation_peak
from vllm_metal.backends.protocol import RunnerMemory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.pooler import Pooler
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.models.encoder import EncoderAdapter

logger = init_logger(__name__)

# vLLM's front end passes a scored pair's token types as the index of the first second-segment
# token (`PoolingParams.extra_kwargs`); before it every token is type 0, from it on type 1.
TOKEN_TYPES_KEY = "compressed_token_type_ids"


class MLXPoolingRunner(MLXModelRunner):
    produces_logits = False

    def __init__(self, vllm_config: VllmConfig):
        super().__init__(vllm_config)
        self.encoder_only = self.model_config.attn_type == "encoder_only"
        self.encoder: EncoderAdapter | None = None
        self.pooler: Pooler | None = None
        # Late-interaction scoring (token_embed rerankers) keeps query embeddings between
        # requests; vLLM's helper for it is plain torch. Its fused kernel needs Triton.
        self.late_interaction = LateInteractionRunner(enable_flash=False)

    # ------------------------------------------------------------ model

    def load_model(self) -> None:
        classifies = is_classifier(self.vllm_config)
        if not self.encoder_only:
            super().load_model()
            classifier = decoder_classifier(self.vllm_config) if classifies else None
        else:
            self._load_encoder()
            classifier = self._encoder_classifier() if classifies else None
        # An encoder's head (BERT's pooler + classifier, RoBERTa's classification head) reads
        # the pooled first token only.
        self.pooler = build_pooler(
            self.vllm_config, classifier, token_classify=not self.encoder_only
        )
        logger.info("Pooling tasks: %s", ", ".join(self.get_supported_tasks()))

    def _load_encoder(self) -> None:
        from vllm_metal.backends.mlx.device import compute_dtype
        from vllm_metal.models import load_encoder

        start = time.perf_counter()
        self.encoder = load_encoder(
            self.model_config.model,
            compute_dtype=compute_dtype(self.mlx_kv_dtype),
            revision=self.model_config.revision,
            download_dir=self.vllm_config.load_config.download_dir,
        )
        logger.info(
            "Model loading took %.2f s; encoder-only, %d layers",
            time.perf_counter() - start,
            self.encoder.num_layers,
        )

    def _encoder_classifier(self):
        encoder = self.encoder
        assert encoder is not None
        if encoder.num_labels is None:
            raise ValueError(
                f"model={self.model_config.model!r}: served for classification, but the "
                "checkpoint has no classification head"
            )

        def classify(pooled: torch.Tensor) -> torch.Tensor:
            logits = encoder.classify(mx.array(pooled.to(torch.float32).numpy()))
            return to_torch(logits.astype(mx.float32))

        return classify

    def get_model(self) -> Any:
        return self.encoder.model if self.encoder is not None else super().get_model()

    def is_loaded(self) -> bool:
        return self.encoder is not None or super().is_loaded()

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        assert self.pooler is not None, "load the model first"
        supported = self.pooler.get_supported_tasks()
        return tuple(task for task in POOLING_TASKS if task in supported)

    # ------------------------------------------------------------ memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {} if self.encoder_only else super().get_kv_cache_spec()

    def memory(self) -> RunnerMemory:
        if self.encoder is None:
            return super().memory()
        return RunnerMemory(weights=self.encoder.weight_bytes, kv_cache=0)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        if not self.encoder_only:
            super().initialize_kv_cache(kv_cache_config)
            return
        assert not kv_cache_config.kv_cache_groups, "encoder-only models have no KV cache"
        self.states.set_block_sizes([])
        logger.info("KV cache: none (encoder-only model)")

    def profile_run(self) -> int:
        if not self.encoder_only:
            return super().profile_run()
        num_tokens = max(1, min(self.max_num_tokens, self.model_config.max_model_len))
        return activation_peak(lambda: mx.eval(self._encode_dummy(num_tokens)))

    def warm_up(self) -> None:
        if not self.encoder_only:
            super().warm_up()
            return
        for n in (1, min(16, self.max_num_tokens)):
            mx.eval(self._encode_dummy(n))
        mx.clear_cache()

    def _encode_dummy(self, num_tokens: int) -> mx.array:
        assert self.encoder is not None, "load the model first"
        token_ids = mx.arange(num_tokens, dtype=mx.int32) % self.model_config.get_vocab_size()
        return self.encoder.encode(token_ids, None, [num_tokens])

    # ------------------------------------------------------------ the step

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._copy_blocks(scheduler_output)
        self.late_interaction.on_requests_finished(scheduler_output.finished_req_ids)
        self.states.update(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.pooling_params
            if params is None:
                raise ValueError(f"request {new.req_id}: a pooling model got a generate request")
            self.pooler.get_pooling_updates(params.task).apply(params)
            self.late_interaction.register_request(new.req_id, params)
        batch = self.states.input_batch
        if scheduler_output.total_num_scheduled_tokens == 0 or batch.num_reqs == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT

        packed = self._pack(scheduler_output)
        hidden = self._hidden_states(packed).astype(mx.float32)
        mx.eval(hidden, *([] if self.kv_pool is None else self.kv_pool.arrays()))
        return self._pool(to_torch(hidden), packed)

    def _hidden_states(self, packed: PackedBatch) -> mx.array:
        """`[T, hidden]` final hidden states of every scheduled token."""
        if self.encoder is not None:
            token_types = _token_type_ids(
                self.states.input_batch.get_pooling_params(), packed.num_scheduled
            )
            return self.encoder.encode(
                mx.array(packed.token_ids),
                None if token_types is None else mx.array(token_types),
                packed.num_scheduled.tolist(),
            )
        assert self.kv_pool is not None, "KV cache not initialized"
        hidden = hidden_states(self.adapter, self.kv_pool, self.layer_kinds, packed)
        return hidden.reshape(packed.num_tokens, -1)

    def _pool(self, hidden: torch.Tensor, packed: PackedBatch) -> ModelRunnerOutput:
        batch = self.states.input_batch
        metadata = batch.get_pooling_metadata()
        metadata.build_pooling_cursor(
            packed.num_scheduled, torch.from_numpy(packed.seq_lens), device=hidden.device
        )
        raw = self.pooler(hidden_states=hidden, pooling_metadata=metadata)
        finished = metadata.get_pooling_cursor().get_finished_mask()
        raw = self.late_interaction.postprocess_pooler_output(
            raw_pooler_output=raw,
            pooling_params=metadata.pooling_params,
            req_ids=batch.req_ids,
            finished_mask=finished,
        )
        outputs: list[torch.Tensor | None] = [None] * batch.num_reqs
        if raw is not None:
            for i, (out, done) in enumerate(zip(raw, finished)):
                if done:
                    outputs[i] = out.contiguous()
        return ModelRunnerOutput(
            req_ids=batch.req_ids.copy(),
            req_id_to_index=batch.req_id_to_index.copy(),
            pooler_output=outputs,
        )

    # ------------------------------------------------------------ sleep mode

    def discard(self, tags: tuple[str, ...]) -> None:
        if "weights" in tags:
            self.encoder = None
        super().discard(tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.encoder_only:
            if "weights" in (tags or ["weights"]) and self.encoder is None:
                self.load_model()
            return
        super().wake_up(tags)


def _token_type_ids(params: list, num_tokens: np.ndarray) -> np.ndarray | None:
    """`[T]` token types of whole prompts packed back to back, or None when all are 0."""
    starts = [(p.extra_kwargs or {}).get(TOKEN_TYPES_KEY) for p in params]
    if all(s is None for s in starts):
        return None
    types = [
        (np.arange(n) >= (n if s is None else s)).astype(np.int32)
        for s, n in zip(starts, num_tokens.tolist())
    ]
    return np.concatenate(types)
