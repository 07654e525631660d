"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa; `vllm_metal.models.encoder`), served for pooling.

They attend bidirectionally over whole prompts: vLLM schedules each prompt in one piece and sizes
no KV cache for them (an empty KV-cache spec), and a step encodes the packed prompts, with the
token types of scored pairs. Their own head (BERT's pooler and classifier, RoBERTa's
classification head) reads the pooled first token only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import torch

from vllm_metal.backends.mlx.runner.model_states.interface import ModelState, StepInputs
from vllm_metal.backends.mlx.runner.tensors import to_torch
from vllm_metal.backends.mlx.runner.warmup import activation_peak

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheSpec

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.pool.heads import Classifier
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.kv.pool import KVPool
    from vllm_metal.models.encoder import EncoderAdapter

# vLLM's front end passes a scored pair's token types as the index of the first second-segment
# token (`PoolingParams.extra_kwargs`); before it every token is type 0, from it on type 1.
TOKEN_TYPES_KEY = "compressed_token_type_ids"


class EncoderOnlyState(ModelState):
    kind = "encoder-only"
    uses_kv_cache = False
    token_classify = False

    def __init__(self, vllm_config: VllmConfig, *, lm_head: bool):
        super().__init__(vllm_config, lm_head=lm_head)
        if lm_head:
            raise ValueError(
                f"model={self.model_config.model!r}: encoder-only models are served for "
                "pooling only (--runner pooling)"
            )
        self.adapter: EncoderAdapter | None = None

    def load(self) -> str:
        from vllm_metal.models import load_encoder

        self.adapter = load_encoder(
            self.model_config.model,
            compute_dtype=self.compute_dtype,
            revision=self.model_config.revision,
            download_dir=self.vllm_config.load_config.download_dir,
        )
        return f"encoder-only, {self.adapter.num_layers} layers"

    def classifier(self) -> Classifier:
        encoder = self.adapter
        assert encoder is not None, "load the model first"
        if encoder.num_labels is None:
            raise ValueError(
                f"model={self.model_config.model!r}: served for classification, but the "
                "checkpoint has no classification head"
            )

        def classify(pooled: torch.Tensor) -> torch.Tensor:
            logits = encoder.classify(mx.array(pooled.to(torch.float32).numpy()))
            return to_torch(logits.astype(mx.float32))

        return classify

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        return {}

    def kv_layer_names(self) -> list[str]:
        return []

    def profile(self, num_tokens: int, block_size: int) -> int:
        return activation_peak(lambda: mx.eval(self._encode_dummy(num_tokens)))

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        for n in (1, min(16, max_num_tokens)):
            mx.eval(self._encode_dummy(n))
        mx.clear_cache()

    def _encode_dummy(self, num_tokens: int) -> mx.array:
        assert self.adapter is not None, "load the model first"
        token_ids = mx.arange(num_tokens, dtype=mx.int32) % self.model_config.get_vocab_size()
        return self.adapter.encode(token_ids, None, [num_tokens])

    def step_inputs(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, states: RequestStates
    ) -> StepInputs:
        params = states.input_batch.get_pooling_params()
        return StepInputs(token_type_ids=token_type_ids(params, packed.num_scheduled))

    def hidden_states(
        self, pool: KVPool | None, packed: PackedBatch, inputs: StepInputs
    ) -> mx.array:
        assert self.adapter is not None, "load the model first"
        token_types = inputs.token_type_ids
        return self.adapter.encode(
            mx.array(packed.token_ids),
            None if token_types is None else mx.array(token_types),
            packed.num_scheduled.tolist(),
        )


def token_type_ids(params: list, num_tokens: np.ndarray) -> np.ndarray | None:
    """`[T]` token types of whole prompts packed back to back, or None when all are 0."""
    starts = [(p.extra_kwargs or {}).get(TOKEN_TYPES_KEY) for p in params]
    if all(s is None for s in starts):
        return None
    types = [
        (np.arange(n) >= (n if s is None else s)).astype(np.int32)
        for s, n in zip(starts, num_tokens.tolist())
    ]
    return np.concatenate(types)
