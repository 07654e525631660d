"""Pooling, the output stage of `--runner pooling` (`output.py`): embeddings, classification and
scoring.

The model is loaded without its LM head and a step ends at the hidden states of every scheduled
token. They go to the host as one float32 tensor, vLLM's own pooler (`heads.py`) pools them per
request (across chunks on a decoder's paged KV cache: chunked prefill and prefix caching work as
for generation) and applies the head with the model kind's classifier. The step returns each
finished request's pooled tensor in `ModelRunnerOutput.pooler_output` (`None` for a request still
prefilling); there is no sampling step. Late-interaction scoring (token_embed rerankers) keeps
query embeddings between requests with vLLM's helper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import torch
from vllm.tasks import POOLING_TASKS
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.pool.late_interaction_runner import LateInteractionRunner

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.runner.pool.heads import build_pooler, is_classifier
from vllm_metal.backends.mlx.runner.tensors import to_torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.pooler import Pooler
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.model_states import ModelState
    from vllm_metal.backends.mlx.runner.output import Forward
    from vllm_metal.backends.mlx.runner.request_state import RequestStates

logger = init_logger(__name__)


class Pooling:
    lm_head = False
    # Nothing is sampled, so there are no drafts to verify.
    features = frozenset({"lora", "kv_connector"})
    spec = None

    def __init__(self, vllm_config: VllmConfig, states: RequestStates, state: ModelState):
        self.vllm_config = vllm_config
        self.states = states
        self.pooler: Pooler | None = None
        # Its fused kernel needs Triton; the plain torch path runs on the host.
        self.late_interaction = LateInteractionRunner(enable_flash=False)

    def load(self, state: ModelState) -> None:
        """vLLM's pooler over the loaded model, with the kind's classifier when served to
        classify."""
        classifier = state.classifier() if is_classifier(self.vllm_config) else None
        self.pooler = build_pooler(
            self.vllm_config, classifier, token_classify=state.token_classify
        )
        logger.info("Pooling tasks: %s", ", ".join(self.supported_tasks(state)))

    def supported_tasks(self, state: ModelState) -> tuple[SupportedTask, ...]:
        assert self.pooler is not None, "load the model first"
        supported = self.pooler.get_supported_tasks()
        return tuple(task for task in POOLING_TASKS if task in supported)

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished requests' queries; apply each new request's pooling params."""
        self.late_interaction.on_requests_finished(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.pooling_params
            if params is None:
                raise ValueError(f"request {new.req_id}: a pooling model got a generate request")
            self.pooler.get_pooling_updates(params.task).apply(params)
            self.late_interaction.register_request(new.req_id, params)

    def finish_step(self, state: ModelState, forward: Forward) -> ModelRunnerOutput:
        """Pool the step's hidden states now; finished requests get their output."""
        packed = forward.packed
        hidden = forward.hidden.reshape(packed.num_tokens, -1).astype(mx.float32)
        mx.eval(hidden, *forward.kv_arrays)
        output = self._pool(to_torch(hidden), packed)
        if forward.connector is not None:
            output.kv_connector_output = forward.connector.finish(forward.scheduler_output)
        return output

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

    def drain(self, scheduler_output: SchedulerOutput, shifts: bool) -> None:
        return None  # pooling steps finish in execute_model

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> None:
        return None
