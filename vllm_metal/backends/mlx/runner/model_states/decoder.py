"""Decoder models through mlx-lm (dense, MoE, sliding-window, hybrid state layers, MLA): they differ
only by their layer kinds (`vllm_metal.models.layers`), which the KV specs, the pool and the
forward's layer caches follow. Every runner feature applies to them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_metal.backends.mlx import cpu_layers
from vllm_metal.backends.mlx.device import device_kind
from vllm_metal.backends.mlx.runner import compiled
from vllm_metal.backends.mlx.runner.forward import hidden_states
from vllm_metal.backends.mlx.runner.model_states.interface import ModelState, StepInputs
from vllm_metal.backends.mlx.runner.warmup import DummyRuns
from vllm_metal.kv.spec import memory_layer_names
from vllm_metal.models import ModelAdapter, load_model
from vllm_metal.models.adapter import LayerRange

if TYPE_CHECKING:
    import mlx.core as mx
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.pool.heads import Classifier
    from vllm_metal.kv.pool import KVPool


class DecoderState(ModelState):
    kind = "decoder"
    features = frozenset({"lora", "speculative_decoding", "kv_connector"})

    def __init__(self, vllm_config: VllmConfig, *, lm_head: bool):
        super().__init__(vllm_config, lm_head=lm_head)
        self.adapter: ModelAdapter | None = None
        parallel = vllm_config.parallel_config
        self.num_layers = self.model_config.get_num_layers(parallel)
        self.layers = pipeline_stage(vllm_config)
        # Decode steps through mx.compile (`compiled.py`), made per load; None: all eager.
        self.compiled: compiled.CompiledDecode | None = None

    def load(self) -> str:
        config = self.model_config
        self.adapter = adapter = load_model(
            config.model,
            compute_dtype=self.compute_dtype,
            dequantize=self.dequantize,
            revision=config.revision,
            download_dir=self.vllm_config.load_config.download_dir,
            trust_remote_code=config.trust_remote_code,
            lm_head=self.lm_head,
            hf_config=config.hf_config.to_dict(),  # what a GGUF file is built from
            language_model_only=language_model_only(config),
            layers=self.layers,
        )
        if adapter.num_layers != self.num_layers:
            raise ValueError(
                f"model={config.model!r}: the MLX model has {adapter.num_layers} "
                f"layers but the config says {self.num_layers}"
            )
        if device_kind() == "cpu":
            cpu_layers.install(adapter.model, config.max_model_len)
        self.layer_kinds = adapter.layer_kinds()
        stage = "" if self.layers is None else f"pipeline stage {self.layers}; "
        return (
            stage
            + "layers: "
            + _summarize(kind.label for kind in self.layer_kinds)
            + (self._compile_decode())
        )

    def _compile_decode(self) -> str:
        """Set up compiled decode steps where they are on and the model allows them; what the
        load log line says of it."""
        self.compiled = None
        if not compiled.enabled(self.vllm_config):
            return ""
        reason = compiled.eager_reason(self.adapter, self.layer_kinds, self.vllm_config)
        if reason is not None:
            return f"; decode steps eager ({reason})"
        self.compiled = compiled.CompiledDecode(self.adapter, self.layer_kinds)
        return "; decode steps compiled"

    def discard_weights(self) -> None:
        super().discard_weights()
        self.compiled = None  # its traces hold the discarded weights

    def classifier(self) -> Classifier:
        from vllm_metal.backends.mlx.runner.pool.heads import decoder_classifier

        return decoder_classifier(self.vllm_config)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        assert self.adapter is not None, "load the model first"
        return self._layer_specs(self.adapter.attention_layer_names, block_size)

    def kv_layer_names(self) -> list[str]:
        assert self.adapter is not None, "load the model first"
        return memory_layer_names(self.adapter.attention_layer_names, self.layer_kinds)

    def profile(self, num_tokens: int, block_size: int) -> int:
        return self._dummy_runs().profile(num_tokens, block_size)

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        self._dummy_runs().warm_up(block_size, max_num_tokens)

    def _dummy_runs(self) -> DummyRuns:
        assert self.adapter is not None, "load the model first"
        return DummyRuns(
            self.adapter,
            self.layer_kinds,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_kv_dtype,
            self.model_config.get_vocab_size(),
            logits=self.lm_head,
            quant=self.kv_cache_quant(),
        )

    @property
    def compiled_traces(self) -> int:
        return 0 if self.compiled is None else self.compiled.traces

    def hidden_states(
        self, pool: KVPool | None, packed: PackedBatch, inputs: StepInputs
    ) -> mx.array:
        assert pool is not None, "KV cache not initialized"
        step = self.compiled
        if step is not None and step.failed is None and step.takes(pool, packed, inputs):
            hidden = step.hidden_states(pool, packed, inputs.aux)
            if hidden is not None:
                return hidden
        return hidden_states(self.adapter, pool, self.layer_kinds, packed, inputs)


def pipeline_stage(vllm_config: VllmConfig) -> LayerRange | None:
    """This worker's decoder layers under pipeline parallelism (vLLM's split, by the worker's
    rank), or None without it."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size == 1:
        return None
    config = vllm_config.model_config
    start, end = config.get_layers_start_end_indices(parallel)
    return LayerRange(start, end, config.get_total_num_hidden_layers())


def language_model_only(model_config) -> bool:
    """vLLM takes no media items for the model (`--language-model-only`, or set by the platform
    where a family's towers do not run)."""
    mm = getattr(model_config, "multimodal_config", None)
    return bool(getattr(mm, "language_model_only", False))


def _summarize(labels) -> str:
    """'full x 4, sliding(32) x 2' in first-seen order."""
    counts: dict[str, int] = {}
    for label in labels:
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{label} x {n}" for label, n in counts.items())
