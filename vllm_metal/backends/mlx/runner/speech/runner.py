"""The runner of speech-to-text models (Whisper): `/v1/audio/transcriptions` and `/translations`.

vLLM's front end decodes the audio, cuts it into 30 s clips and turns each clip into one request:
log-mel features as the request's audio item (`mm_features`) and a decoder prompt of special
tokens (`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`). The scheduler treats the
model as encoder-decoder: no chunked prefill, no prefix caching, the encoder scheduled on the
request's first step (again after a preemption), and a cross-attention KV group sized for the
encoder states.

This runner extends the generating runner (request state, packing, sampling with vLLM's
sampler, async steps). On each step it encodes the newly scheduled clips in one batch, writes
their cross-attention K/V into the pool, and runs the decoder over every scheduled token with
self-attention and cross-attention both paged (`cross.py`): many transcriptions decode together.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from vllm.v1.kv_cache_interface import CrossAttentionSpec

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.device import compute_dtype
from vllm_metal.backends.mlx.runner.batch import PackedBatch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches, logits_of
from vllm_metal.backends.mlx.runner.model_runner import MLXModelRunner
from vllm_metal.backends.mlx.runner.speech.cross import cross_inputs
from vllm_metal.backends.mlx.runner.warmup import activation_peak
from vllm_metal.kv.paged_cache import PagedLayerCache
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import load_speech_model

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.tasks import SupportedTask
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.models.families.whisper import WhisperAdapter

logger = init_logger(__name__)

# The processor's field holding a clip's log-mel features ([n_mels, frames]).
FEATURES_KEY = "input_features"
# Decoder tokens per request in the profiling and warm-up steps (a transcription prompt's size).
_DUMMY_PROMPT_LEN = 4


class MLXSpeechRunner(MLXModelRunner):
    def __init__(self, vllm_config: VllmConfig):
        super().__init__(vllm_config)
        # Encoder inputs a step may schedule (the request states size the cross-attention
        # group's block tables for them).
        self.max_encoder_len = vllm_config.scheduler_config.max_num_encoder_input_tokens
        self.cross_group = 0  # the cross-attention group's index, from vLLM's KV plan

    @property
    def speech(self) -> WhisperAdapter:
        assert self.adapter is not None, "load the model first"
        return self.adapter  # type: ignore[return-value]

    # ------------------------------------------------------------ model

    def load_model(self) -> None:
        start = time.perf_counter()
        load_config = self.vllm_config.load_config
        self.adapter = adapter = load_speech_model(
            self.model_config.model,
            compute_dtype=compute_dtype(self.mlx_kv_dtype),
            revision=self.model_config.revision,
            download_dir=load_config.download_dir,
        )
        self.num_layers = adapter.num_layers
        self.num_kv_heads = adapter.num_kv_heads
        self.head_dim = adapter.head_dim
        self.layer_kinds = adapter.layer_kinds()
        logger.info(
            "Model loading took %.2f s; Whisper: %d encoder and %d decoder layers, "
            "%d encoder positions",
            time.perf_counter() - start,
            adapter.args.encoder_layers,
            adapter.num_layers,
            adapter.encoder_length,
        )

    def get_supported_tasks(self) -> tuple[SupportedTask, ...]:
        return ("transcription",)

    # ------------------------------------------------------------ memory

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        specs = super().get_kv_cache_spec()
        cross = CrossAttentionSpec(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.kv_dtype,
        )
        specs.update({name: cross for name in self.speech.cross_attention_layer_names})
        return specs

    def _kv_layer_names(self) -> list[str]:
        return self.speech.attention_layer_names + self.speech.cross_attention_layer_names

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        groups = kv_cache_config.kv_cache_groups
        cross = [
            g
            for g, group in enumerate(groups)
            if isinstance(group.kv_cache_spec, CrossAttentionSpec)
        ]
        if len(cross) != 1:
            raise ValueError(f"expected one cross-attention KV-cache group, got {len(cross)}")
        self.cross_group = cross[0]
        super().initialize_kv_cache(kv_cache_config)

    def profile_run(self) -> int:
        clips = max(1, self.max_encoder_len // self.speech.encoder_length)
        clips = min(clips, self.vllm_config.scheduler_config.max_num_seqs)
        # The scratch pool is allocated before the measurement starts and freed after it.
        run = functools.partial(self._dummy_step, clips, self._scratch_pool(clips))
        peak = activation_peak(run)
        del run
        mx.clear_cache()
        return peak

    def warm_up(self) -> None:
        self._dummy_step(1, self._scratch_pool(1))
        mx.clear_cache()

    def _blocks_per_clip(self) -> tuple[int, int]:
        """(decoder prompt blocks, encoder blocks) of one dummy request."""
        bs = self.block_size
        return -(-_DUMMY_PROMPT_LEN // bs), -(-self.speech.encoder_length // bs)

    def _scratch_pool(self, clips: int) -> KVPool:
        """Every layer in its own region; self-attention group 0, cross-attention group 1."""
        layers = self.speech.num_layers
        layout = KVLayout(
            num_blocks=clips * sum(self._blocks_per_clip()),
            block_size=self.block_size,
            region_of_layer=tuple(range(2 * layers)),
            group_of_layer=(0,) * layers + (1,) * layers,
        )
        return KVPool(layout, self.num_kv_heads, self.head_dim, self.mlx_kv_dtype)

    def _dummy_step(self, clips: int, pool: KVPool) -> None:
        """Encode `clips` silent clips and decode a prompt for each, in a scratch pool."""
        adapter = self.speech
        prompt_blocks, encoder_blocks = self._blocks_per_clip()
        first = np.arange(clips, dtype=np.int32)[:, None] * (prompt_blocks + encoder_blocks)
        n = _DUMMY_PROMPT_LEN
        packed = pack_batch(
            [f"dummy-{i}" for i in range(clips)],
            {f"dummy-{i}": n for i in range(clips)},
            np.zeros(clips, dtype=np.int32),
            np.full(clips, n, dtype=np.int32),
            np.zeros((clips, n), dtype=np.int32),
            [first + np.arange(prompt_blocks)],
            [self.block_size],
        )
        cross_table = first + prompt_blocks + np.arange(encoder_blocks)
        features = mx.zeros((clips, self._num_mel_bins, 2 * adapter.encoder_length))
        encoder_lens = np.full(clips, adapter.encoder_length, dtype=np.int64)
        hidden = self._decode(packed, pool, features, cross_table, encoder_lens, np.arange(clips))
        mx.eval(logits_of(adapter, hidden, packed, {})[0])

    @property
    def _num_mel_bins(self) -> int:
        return self.speech.args.num_mel_bins

    # ------------------------------------------------------------ the step

    def _forward(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, prompt_rows
    ) -> tuple[mx.array, dict[str, mx.array]]:
        batch = self.states.input_batch
        encoding = scheduler_output.scheduled_encoder_inputs
        rows = np.array(
            [i for i, req_id in enumerate(packed.req_ids) if req_id in encoding], dtype=np.int64
        )
        features = None
        if rows.size:
            features = mx.array(np.stack([self._features(packed.req_ids[i]) for i in rows]))
        encoder_lens = np.array(
            [self._encoder_len(req_id) for req_id in packed.req_ids], dtype=np.int64
        )
        cross_table = batch.block_table[self.cross_group].get_numpy_array()
        hidden = self._decode(packed, self.kv_pool, features, cross_table, encoder_lens, rows)
        return logits_of(self.adapter, hidden, packed, prompt_rows)

    def _decode(
        self,
        packed: PackedBatch,
        pool: KVPool,
        features: mx.array | None,
        cross_table: np.ndarray,
        encoder_lens: np.ndarray,
        encoded_rows: np.ndarray,
    ) -> mx.array:
        """Hidden states of the packed decoder tokens; `features` of `encoded_rows` are encoded
        and their cross-attention K/V written first. Lazy."""
        adapter = self.speech
        caches = layer_caches(pool, packed, self.layer_kinds)[: adapter.num_layers]
        cross = cross_inputs(packed, cross_table, encoder_lens, encoded_rows, pool.block_size)
        meta, tables = cross.device_views(packed.positions)
        layout = pool.layout
        cross_caches = [
            PagedLayerCache(
                pool, layout.region_of_layer[adapter.num_layers + i], meta, tables, None
            )
            for i in range(adapter.num_layers)
        ]
        states = None
        if features is not None:
            encoded = adapter.encode(features)  # [N, L, d]
            lengths = set(encoder_lens[encoded_rows].tolist())
            if lengths != {encoded.shape[1]}:
                raise ValueError(
                    f"the encoder gives {encoded.shape[1]} states per clip, but vLLM placed "
                    f"{sorted(lengths)} (the feature extractor's frames do not fit this model)"
                )
            states = encoded.reshape(-1, encoded.shape[-1])
        return adapter.decode(
            mx.array(packed.token_ids),
            mx.array(packed.positions),
            caches,
            cross_caches,
            states,
        )

    def _features(self, req_id: str) -> np.ndarray:
        """The request's clip as log-mel features `[n_mels, frames]` (float32)."""
        features = self.states.requests[req_id].mm_features or []
        if len(features) != 1 or features[0].data is None or FEATURES_KEY not in features[0].data:
            raise ValueError(
                f"request {req_id}: a speech-to-text request carries one audio clip's "
                f"{FEATURES_KEY!r}, got {len(features)} item(s)"
            )
        return features[0].data[FEATURES_KEY].data.float().numpy()

    def _encoder_len(self, req_id: str) -> int:
        features = self.states.requests[req_id].mm_features or []
        return sum(f.mm_position.length for f in features)
