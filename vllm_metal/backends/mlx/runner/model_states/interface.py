"""What a model kind is to the runner: `ModelState`, and `StepInputs`, the one value that carries
what a kind's forward takes beyond the packed batch.

The runner (`model_runner.py`) holds what every kind shares: request state, packing, the KV pool,
the output stage (sampling or pooling), LoRA, speculative decoding and the KV connector. A kind
(`decoder`, `multimodal`, `encoder_only`, `encoder_decoder`) owns the rest: loading its model
with the checks that apply to it, its KV-cache specs and layers, its dummy steps (profiling and
warm-up), the memory its weights hold, and each step's extra inputs and forward. A new kind is a
file here and a line in `select`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_metal.backends.mlx.device import compute_dtype, dense_on_this_device
from vllm_metal.backends.mlx.dtypes import to_mlx_dtype
from vllm_metal.kv.spec import kv_cache_specs

if TYPE_CHECKING:
    from collections.abc import Mapping

    import mlx.core as mx
    import numpy as np
    from vllm.config import VllmConfig
    from vllm.tasks import GenerationTask
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from vllm_metal.backends.mlx.runner.batch import PackedBatch
    from vllm_metal.backends.mlx.runner.pool.heads import Classifier
    from vllm_metal.backends.mlx.runner.request_state import RequestStates
    from vllm_metal.backends.mlx.runner.speech.cross import CrossInputs
    from vllm_metal.kv.pool import KVLayout, KVPool
    from vllm_metal.kv.quant import KVCacheQuant
    from vllm_metal.kv.state_drafts import StepDrafts
    from vllm_metal.kv.turboquant import TurboQuantCache
    from vllm_metal.models.layers import LayerKind
    from vllm_metal.models.multimodal import TokenRows

# The runner features a kind may take part in, by the flag that asks for them (the refusal names
# the flag; `vllm_metal.config.table` refuses the same combinations earlier, at startup).
FEATURE_FLAGS = {
    "lora": "--enable-lora",
    "speculative_decoding": "--speculative-config",
    "kv_connector": "--kv-transfer-config / --kv-offloading-size",
}


@dataclass(frozen=True)
class StepInputs:
    """A step's inputs beyond the packed batch; each kind fills the fields it uses, the rest stay
    None (a plain decoder's step has none)."""

    # Multimodal decoders: encoder rows written over their placeholder tokens' embeddings.
    mm_rows: TokenRows | None = None
    # M-RoPE models: the three position streams of every packed token, `[3, T]`.
    mrope_positions: np.ndarray | None = None
    # Prefix-LM models: how far each packed token attends (`[T]`, 0 = causal; `mm/spans.py`).
    key_ends: np.ndarray | None = None
    # Encoder-only models: the token types of scored pairs, `[T]` (None = all 0).
    token_type_ids: np.ndarray | None = None
    # Encoder-decoder models: the clips encoded this step (`[N, mels, frames]`, in the order
    # their states fill `cross.slot_mapping`) and every decoder token's cross-attention.
    encoder_features: mx.array | None = None
    cross: CrossInputs | None = None
    # Hybrid models on a step verifying drafts: the expanded rows of the state layers and the
    # candidate states they leave (`kv.state_drafts`).
    drafts: StepDrafts | None = None
    # Pipeline stages after the first: the previous stage's hidden states of every packed token
    # (`[T, 1, hidden]`), in place of the token embeddings.
    stage_hidden: mx.array | None = None
    # An EAGLE-3 drafter: the target layers whose input hidden states the step keeps.
    aux: AuxHidden | None = None


@dataclass
class AuxHidden:
    """The target's hidden states an EAGLE-3 head reads (`spec_decode/eagle3.py`): the input of
    each decoder layer in `layer_ids` (L: the last layer's output before the final norm), filled
    by the forward for every packed token, joined in layer order (`[T, 1, n * hidden]`, lazy)."""

    layer_ids: tuple[int, ...]
    states: mx.array | None = None


NO_INPUTS = StepInputs()


class ModelState:
    """One model kind's part of the runner. Subclasses set `kind` and `features` and implement
    the methods that raise `NotImplementedError` here."""

    kind: ClassVar[str]
    # The keys of `FEATURE_FLAGS` this kind runs; the runner refuses the others at load.
    features: ClassVar[frozenset[str]] = frozenset()
    # False: the kind declares no KV cache (vLLM schedules each prompt whole).
    uses_kv_cache: ClassVar[bool] = True
    # Whether a classifier head may run on every token (`token_classify`): off for heads meant
    # for one pooled row.
    token_classify: ClassVar[bool] = True

    def __init__(self, vllm_config: VllmConfig, *, lm_head: bool):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.lm_head = lm_head  # False under pooling: steps end at the hidden states
        self.kv_dtype = self.model_config.dtype  # what vLLM sized the cache for
        self.mlx_kv_dtype = to_mlx_dtype(self.kv_dtype)
        self.compute_dtype = compute_dtype(self.mlx_kv_dtype)
        self.dequantize = dense_on_this_device()
        # The kind's adapter (`vllm_metal.models`): set by `load`, None while discarded.
        self.adapter: Any = None
        self.layer_kinds: list[LayerKind] = []  # read from the model once per load
        parallel = vllm_config.parallel_config
        self.num_kv_heads = self.model_config.get_num_kv_heads(parallel)
        self.head_dim = self.model_config.get_head_size()

    # ------------------------------------------------------------ model

    def load(self) -> str:
        """Load the weights into `self.adapter`; returns what the load log line says of them."""
        raise NotImplementedError

    def get_model(self) -> Any:
        return None if self.adapter is None else self.adapter.model

    def is_loaded(self) -> bool:
        return self.adapter is not None

    def weight_bytes(self) -> int:
        return 0 if self.adapter is None else self.adapter.weight_bytes

    def discard_weights(self) -> None:
        self.adapter = None

    def generation_tasks(self) -> tuple[GenerationTask, ...]:
        """What the kind generates when its steps end in sampling."""
        return ("generate",)

    def classifier(self) -> Classifier:
        """The model's classifier over pooled hidden states (pooling models served to classify)."""
        raise ValueError(
            f"model={self.model_config.model!r}: a {self.kind} model has no classifier"
        )

    # ------------------------------------------------------------ KV cache

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """vLLM's spec of every layer with KV memory, keyed by the layer's module name."""
        raise NotImplementedError

    def kv_layer_names(self) -> list[str]:
        """The layers with KV memory in the pool, in the order of the pool's regions."""
        raise NotImplementedError

    def bind_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Read what the kind needs from vLLM's KV plan (the runner allocates the pool)."""

    def make_kv_pool(self, layout: KVLayout) -> KVPool:
        from vllm_metal.kv.pool import pool_for

        return pool_for(
            layout,
            self.layer_kinds,
            self.num_kv_heads,
            self.head_dim,
            self.mlx_kv_dtype,
            self.kv_cache_quant(),
        )

    def kv_cache_quant(self) -> KVCacheQuant | TurboQuantCache | None:
        """The fp8 cache `--kv-cache-dtype` asks for (`kv.quant`), its scales from the
        checkpoint where it has them (a local checkpoint directory), or the TurboQuant one
        (`kv.turboquant`); None for an unquantized cache."""
        from pathlib import Path

        from vllm_metal.kv import turboquant
        from vllm_metal.kv.quant import kv_cache_quant

        cache_config = self.vllm_config.cache_config
        if turboquant.requested(cache_config.cache_dtype):
            return turboquant.TurboQuantCache.of(cache_config, self.layer_kinds)

        local = Path(self.model_config.model).expanduser()
        # The checkpoint names scales by decoder layer, which each layer's module name holds.
        names = getattr(self.adapter, "attention_layer_names", None)
        return kv_cache_quant(
            self.vllm_config.cache_config.cache_dtype,
            len(self.layer_kinds),
            local if local.is_dir() else None,
            names if names is not None and len(names) == len(self.layer_kinds) else None,
        )

    def _layer_specs(self, names: list[str], block_size: int) -> dict[str, KVCacheSpec]:
        """The specs of decoder layers `names`, one per layer kind."""
        return kv_cache_specs(
            names,
            self.layer_kinds,
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            cache_config=self.vllm_config.cache_config,
        )

    # ------------------------------------------------------------ dummy steps

    def profile(self, num_tokens: int, block_size: int) -> int:
        """Peak bytes of a full-size step of `num_tokens` beyond what is allocated now."""
        raise NotImplementedError

    def warm_up(self, block_size: int, max_num_tokens: int) -> None:
        """Run the first steps' shapes once, so the first request does not pay MLX's setup."""
        raise NotImplementedError

    # ------------------------------------------------------------ the step

    def step_inputs(
        self, scheduler_output: SchedulerOutput, packed: PackedBatch, states: RequestStates
    ) -> StepInputs:
        """This step's inputs beyond the packed batch (a plain decoder has none)."""
        return NO_INPUTS

    @property
    def compiled_traces(self) -> int:
        """How many step shapes the state's compiled forward has traced (0 where it has none):
        a step during which this grew paid for tracing (`compiled.CompiledDecode`)."""
        return 0

    def hidden_states(
        self, pool: KVPool | None, packed: PackedBatch, inputs: StepInputs
    ) -> mx.array:
        """Final hidden states of every packed token (`[T, ...]`), writing the step's K/V. Lazy."""
        raise NotImplementedError

    def logits(
        self, hidden: mx.array, packed: PackedBatch, prompt_rows: Mapping[str, np.ndarray]
    ) -> tuple[mx.array, dict[str, mx.array]]:
        """Float32 logits of the rows that are sampled and of prompt-logprob rows. Lazy."""
        from vllm_metal.backends.mlx.runner.forward import logits_of

        return logits_of(self.adapter, hidden, packed, prompt_rows)

    def reset_encoder_cache(self) -> None:
        """Forget every encoded media item (only kinds with towers keep any)."""
