"""Encoder-decoder speech-to-text models (Whisper; `vllm_metal.models.families.whisper`).

vLLM's front end turns each 30 s clip into one request: log-mel features as its audio item and a
decoder prompt of special tokens. The scheduler treats the model as encoder-decoder: no chunked
prefill, no prefix caching, the encoder scheduled on a request's first step (again after a
preemption), and a second KV-cache group (`CrossAttentionSpec`) sized for the encoder states.
A step encodes the newly scheduled clips in one batch, writes their cross-attention K/V into the
pool, and decodes every scheduled token with self- and cross-attention both paged
(`speech/cross.py`): many transcriptions decode together.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.kv_cache_interface import CrossAttentionSpec

from vllm_metal.backends.mlx.runner.batch import PackedBatch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches, step_token_ids
from vllm_metal.backends.mlx.runner.model_states.interface import ModelState, StepInputs
from vllm_metal.backends.mlx.runner.speech.cross import cross_inputs
from vllm_metal.backends.mlx.runner.warmup import activation_peak
from vllm_metal.kv.paged_cache import PagedLayerCache
from vllm_metal.kv.pool import KVLayout, KVPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import GenerationTask
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.models.families.whisper import WhisperAdapter

# The processor's field holding a clip's log-mel features ([n_mels, frames]).
FEATURES_KEY = "input_features"
# Decoder tokens per request in the profiling and warm-up steps (a transcription prompt's size).
_DUMMY_PROMPT_LEN = 4


class EncoderDecoderState(ModelState):
    kind = "encoder-decoder"

    def __init__(self, vllm_config: VllmConfig, *, lm_head: bool):
        super().__init__(vllm_config, lm_head=lm_head)
        if not lm_head:
            raise ValueError(
                f"model={self.model_config.model!r}: encoder-decoder models are served for "
                "transcription only, not --runner pooling"
            )
        self.adapter: WhisperAdapter | None = None
        # Encoder inputs a step may schedule (bounds the clips of the profiling step).
        self.max_encoder_len = vllm_config.scheduler_config.max_num_encoder_input_tokens
        self.cross_group = 0  # the cross-attention group's index, from vLLM's KV plan
        self.cross_block_size = vllm_config.cache_config.block_size

    def load(self) -> str:
        from vllm_metal.models import load_speech_model

        self.adapter = adapter = load_speech_model(
            self.model_config.model,
            compute_dtype=self.compute_dtype,
            revision=self.model_config.revision,
            download_dir=self.vllm_config.load_config.download_dir,
        )
        # Whisper's decoder is what vLLM's config describes only in part: take its own figures.
        self.num_kv_heads = adapter.num_kv_heads
        self.head_dim = adapter.head_dim
        self.layer_kinds = adapter.layer_kinds()
        return (
            f"Whisper: {adapter.args.encoder_layers} encoder and {adapter.num_layers} decoder "
            f"layers, {adapter.encoder_length} encoder positions"
        )

    def generation_tasks(self) -> tuple[GenerationTask, ...]:
        return ("transcription",)

    # ------------------------------------------------------------ KV cache

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        assert self.adapter is not None, "load the model first"
        specs = self._layer_specs(self.adapter.attention_layer_names, block_size)
        cross = CrossAttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.kv_dtype,
        )
        specs.update({name: cross for name in self.adapter.cross_attention_layer_names})
        return specs

    def kv_layer_names(self) -> list[str]:
        assert self.adapter is not None, "load the model first"
        return self.adapter.attention_layer_names + self.adapter.cross_attention_layer_names

    def bind_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        groups = kv_cache_config.kv_cache_groups
        cross = [
            g
            for g, group in enumerate(groups)
            if isinstance(group.kv_cache_spec, CrossAttentionSpec)
        ]
        if len(cross) != 1:
            raise ValueError(f"expected one cross-attention KV-cache group, got {len(cross)}")
        self.cross_group = cross[0]
        self.cross_block_size = groups[cross[0]].kv_cache_spec.block_size

    # ------------------------------------------------------------ dummy steps

    def profile(self, num_tokens: int, block_size: int) -> int:
        assert self.adapter is not None, "load the model first"
        clips = max(1, self.max_encoder_len // self.adapter.encoder_length)
        clips = min(clips, self.vllm_config.scheduler_config.max_num_seqs)
        # The scratch pool is allocated before the measurement starts and freed after it.
        pool = self._scratch_pool(clips, block_size)
        run = functools.partial(self._dummy_step, clips, pool)
        peak = activation_peak(run)
        del run, pool
        mx.clear_cache()
        return peak

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        self._dummy_step(1, self._scratch_pool(1, block_size))
        mx.clear_cache()

    def _blocks_per_clip(self, block_size: int) -> tuple[int, int]:
        """(decoder prompt blocks, encoder blocks) of one dummy request."""
        return -(-_DUMMY_PROMPT_LEN // block_size), -(-self.adapter.encoder_length // block_size)

    def _scratch_pool(self, clips: int, block_size: int) -> KVPool:
        """Every layer in its own region; self-attention group 0, cross-attention group 1."""
        layers = self.adapter.num_layers
        layout = KVLayout(
            num_blocks=clips * sum(self._blocks_per_clip(block_size)),
            block_size=block_size,
            region_of_layer=tuple(range(2 * layers)),
            group_of_layer=(0,) * layers + (1,) * layers,
        )
        return self.make_kv_pool(layout)

    def _dummy_step(self, clips: int, pool: KVPool) -> None:
        """Encode `clips` silent clips and decode a prompt for each, in a scratch pool."""
        adapter = self.adapter
        block_size = pool.block_size
        prompt_blocks, encoder_blocks = self._blocks_per_clip(block_size)
        first = np.arange(clips, dtype=np.int32)[:, None] * (prompt_blocks + encoder_blocks)
        n = _DUMMY_PROMPT_LEN
        packed = pack_batch(
            [f"dummy-{i}" for i in range(clips)],
            {f"dummy-{i}": n for i in range(clips)},
            np.zeros(clips, dtype=np.int32),
            np.full(clips, n, dtype=np.int32),
            np.zeros((clips, n), dtype=np.int32),
            [first + np.arange(prompt_blocks)],
            [block_size],
        )
        cross_table = first + prompt_blocks + np.arange(encoder_blocks)
        encoder_lens = np.full(clips, adapter.encoder_length, dtype=np.int64)
        inputs = StepInputs(
            encoder_features=mx.zeros(
                (clips, adapter.args.num_mel_bins, 2 * adapter.encoder_length)
            ),
            cross=cross_inputs(packed, cross_table, encoder_lens, np.arange(clips), block_size),
        )
        hidden = self.hidden_states(pool, packed, inputs)
        mx.eval(self.logits(hidden, packed, {})[0])

    # ------------------------------------------------------------ the step

    def step_inputs(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, states: RequestStates
    ) -> StepInputs:
        encoding = scheduler_output.scheduled_encoder_inputs
        rows = np.array(
            [i for i, req_id in enumerate(packed.req_ids) if req_id in encoding], dtype=np.int64
        )
        features = None
        if rows.size:
            features = mx.array(np.stack([_features(states, packed.req_ids[i]) for i in rows]))
        encoder_lens = np.array(
            [_encoder_len(states, req_id) for req_id in packed.req_ids], dtype=np.int64
        )
        cross_table = states.input_batch.block_table[self.cross_group].get_numpy_array()
        return StepInputs(
            encoder_features=features,
            cross=cross_inputs(packed, cross_table, encoder_lens, rows, self.cross_block_size),
        )

    def hidden_states(
        self, pool: KVPool | None, packed: PackedBatch, inputs: StepInputs
    ) -> mx.array:
        """Hidden states of the packed decoder tokens; the clips in `inputs.encoder_features`
        are encoded and their cross-attention K/V written first. Lazy."""
        adapter = self.adapter
        cross = inputs.cross
        assert pool is not None, "KV cache not initialized"
        assert adapter is not None and cross is not None
        caches = layer_caches(pool, packed, self.layer_kinds)[: adapter.num_layers]
        meta, tables = cross.device_views(packed.positions)
        regions = pool.layout.region_of_layer
        cross_caches = [
            PagedLayerCache(pool, regions[adapter.num_layers + i], meta, tables, None)
            for i in range(adapter.num_layers)
        ]
        states = None
        if inputs.encoder_features is not None:
            encoded = adapter.encode(inputs.encoder_features)  # [N, L, d]
            lengths = set(cross.encoded_lens.tolist())
            if lengths != {encoded.shape[1]}:
                raise ValueError(
                    f"the encoder gives {encoded.shape[1]} states per clip, but vLLM placed "
                    f"{sorted(lengths)} (the feature extractor's frames do not fit this model)"
                )
            states = encoded.reshape(-1, encoded.shape[-1])
        return adapter.decode(
            step_token_ids(packed), mx.array(packed.positions), caches, cross_caches, states
        )


def _features(states: RequestStates, req_id: str) -> np.ndarray:
    """The request's clip as log-mel features `[n_mels, frames]` (float32)."""
    features = states.requests[req_id].mm_features or []
    if len(features) != 1 or features[0].data is None or FEATURES_KEY not in features[0].data:
        raise ValueError(
            f"request {req_id}: a speech-to-text request carries one audio clip's "
            f"{FEATURES_KEY!r}, got {len(features)} item(s)"
        )
    return features[0].data[FEATURES_KEY].data.float().numpy()


def _encoder_len(states: RequestStates, req_id: str) -> int:
    features = states.requests[req_id].mm_features or []
    return sum(f.mm_position.length for f in features)
