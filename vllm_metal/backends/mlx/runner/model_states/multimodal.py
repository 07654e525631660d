"""Vision-language decoders (mlx-vlm checkpoints of the model types families declare as
`vision_language`): a decoder whose towers encode the media items the scheduler schedules. The
state keeps their outputs in an `EncoderCache` and gives each step the rows its tokens take, the
M-RoPE positions of models with three position streams and the key ends of prefix-LM models
(`mm/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.backends.mlx.runner.mm.embeddings import EncoderCache
from vllm_metal.backends.mlx.runner.mm.mrope import step_positions
from vllm_metal.backends.mlx.runner.mm.profile import encoder_peak
from vllm_metal.backends.mlx.runner.mm.spans import step_key_ends
from vllm_metal.backends.mlx.runner.model_states.decoder import DecoderState
from vllm_metal.backends.mlx.runner.model_states.interface import StepInputs
from vllm_metal.models.multimodal import MultimodalAdapter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import GenerationTask
    from vllm.v1.core.sched.output import SchedulerOutput

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.request_state import RequestStates


class MultimodalState(DecoderState):
    kind = "multimodal"

    def __init__(self, vllm_config: VllmConfig, *, lm_head: bool):
        super().__init__(vllm_config, lm_head=lm_head)
        # Encoder outputs of media items under vLLM's identifiers, until the scheduler frees them.
        self.encoder_cache = EncoderCache()

    def load(self) -> str:
        described = super().load()
        if not isinstance(self.adapter, MultimodalAdapter):
            raise TypeError(
                f"model={self.model_config.model!r}: a vision-language checkpoint did not load "
                f"with its towers (got {type(self.adapter).__name__})"
            )
        return described

    def generation_tasks(self) -> tuple[GenerationTask, ...]:
        # A speech model whose audio rows enter a decoder (Qwen3-ASR) also transcribes.
        if getattr(self.adapter, "transcribes", False):
            return ("generate", "transcription")
        return ("generate",)

    def profile(self, num_tokens: int, block_size: int) -> int:
        # A step encodes its images before the decoder runs.
        peak = super().profile(num_tokens, block_size)
        return peak + encoder_peak(self.vllm_config, self.adapter)

    def step_inputs(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, states: RequestStates
    ) -> StepInputs:
        adapter = self.adapter
        requests = states.requests
        self.encoder_cache.update(scheduler_output, requests, adapter)
        return StepInputs(
            mm_rows=self.encoder_cache.step_rows(packed, requests),
            mrope_positions=(
                step_positions(packed, requests, adapter) if adapter.uses_mrope else None
            ),
            key_ends=step_key_ends(packed, requests) if adapter.bidirectional_media else None,
        )

    def reset_encoder_cache(self) -> None:
        self.encoder_cache.clear()
