"""Falcon-H1: every decoder layer runs a Mamba-2 mixer and attention side by side on the same normed
input, adds both to the residual, then a SwiGLU MLP; muP multipliers scale the embeddings, each
branch's input and output, the key, the parts of the mixer's input projection, the MLP and the
logits. Mirrors mlx-lm 0.32.2 (`models/falcon_h1.py`), whose `sanitize` folds the multipliers
into the weights.

Memory: each decoder layer holds two memory layers, its attention's KV pages
(`model.layers.{i}.self_attn`) and its mixer's state pages (`model.layers.{i}.mamba`), in that
order (`MEMORY`): two entries in the runner's layer kinds and names, two caches handed to each
layer by `forward`. vLLM groups them as any hybrid's: the attention layers in one KV-cache group,
the mixers in another, attention layer `i` and mixer `i` over the same memory. (vLLM's own model
names them `model.layers.{i}.attn` and `model.{N+i}.mixer`, for its GPU runner's one-index-per-
layer binding, which this runner does not use.) The mixer runs Granite 4.0-H's packed Mamba-2 scan
(`granitemoehybrid.packed_mamba2_scan`) on the requests' state pages, then Falcon-H1's gate.

Where mlx-lm 0.32.2 departs from transformers, the loaded model is brought to transformers'
(`_match_transformers`, on the weights mlx-lm folded, so for Hugging Face checkpoints and for
checkpoints converted by mlx-lm alike):
- the key multiplier is never applied (mlx-lm's `sanitize` looks for a `key_proj` that no
  checkpoint has): keys are scaled by `key_multiplier` here;
- transformers scales the attention's input by `attention_in_multiplier`, so values too; mlx-lm
  folds it into the queries and keys only: values are scaled here;
- multipliers of a projection's output are folded into its weight, not its bias (`o_proj`,
  `out_proj`, the MLP's `gate_proj` and `down_proj`, the mixer's `in_proj`): biases are scaled
  here (the configs' bias flags are off by default);
- the gated RMSNorm after the scan (`mamba_rms_norm`) normalises the whole width where
  transformers (and vLLM) normalise each group's slice: `GroupedGatedRMSNorm` replaces it.
vLLM 0.32's own model departs from transformers elsewhere (what is served here is transformers'):
it gives the attention and MLP projections no biases (`attention_bias`, `mlp_bias`), the mixer's
`out_proj` a bias by `mamba_proj_bias` instead of `projectors_bias`, and applies the gate before
the norm whatever `mamba_norm_before_gate` says.

A config.json must carry every multiplier: mlx-lm's defaults for missing ones are not
transformers' (1).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu

from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.families.granitemoehybrid import packed_mamba2_scan
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, state_shapes_of

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("falcon_h1",)
KIND = "state_hybrid"
MODALITIES: tuple[str, ...] = ()

# The memory layers of each decoder layer, in order: its attention and its Mamba-2 mixer.
MEMORY = ("self_attn", "mamba")

# The multipliers transformers applies; mlx-lm has other defaults for them.
MULTIPLIERS = (
    "embedding_multiplier",
    "attention_in_multiplier",
    "key_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_multipliers",
    "ssm_out_multiplier",
    "mlp_multipliers",
    "lm_head_multiplier",
)


class Adapter(ModelAdapter):
    def __init__(self, model: Any, config: dict[str, Any]):
        super().__init__(model, config)
        missing = [key for key in MULTIPLIERS if key not in config]
        if missing:
            raise ValueError(
                f"vllm-metal: this Falcon-H1 config.json lacks {', '.join(missing)}; mlx-lm would "
                "use its own defaults where transformers uses 1: write them into it"
            )
        self._match_transformers()

    @cached_property
    def attention_layer_names(self) -> list[str]:
        return [f"model.layers.{i}.{part}" for i in range(self.num_layers) for part in MEMORY]

    def layer_kinds(self) -> list[LayerKind]:
        state = LayerKind(is_state=True, state=state_shapes_of(self.model_type, self.config))
        return [FULL_ATTENTION, state] * self.num_layers

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        """FalconH1Model.__call__ over packed rows (the embedding multiplier is in the embedding
        weights): each decoder layer takes its attention's and its mixer's cache (`MEMORY`)."""
        if len(caches) != len(MEMORY) * self.num_layers:
            raise ValueError(f"{len(caches)} caches for {self.num_layers} Falcon-H1 layers")
        h = input_embeds
        for i, layer in enumerate(self.decoder.layers):
            attention_cache, state_cache = caches[2 * i], caches[2 * i + 1]
            x = layer.input_layernorm(h)
            mixed = packed_falcon_h1_mixer(layer.mamba, x, state_cache)
            h = h + mixed + layer.self_attn(x, None, attention_cache)
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        return self.decoder.final_layernorm(h)

    def _match_transformers(self) -> None:
        """Bring the model mlx-lm loaded to transformers' (module docstring)."""
        c = self.config
        gate_multiplier, down_multiplier = c["mlp_multipliers"]
        mup = self.decoder._mup_vector
        for layer in self.decoder.layers:
            attn, mixer, mlp = layer.self_attn, layer.mamba, layer.feed_forward
            _scale_outputs(attn.k_proj, c["key_multiplier"], bias=True)
            _scale_outputs(attn.v_proj, c["attention_in_multiplier"], bias=False)
            _scale_bias(attn.o_proj, c["attention_out_multiplier"])
            _scale_bias(mlp.gate_proj, gate_multiplier)
            _scale_bias(mlp.down_proj, down_multiplier)
            _scale_bias(mixer.in_proj, mup)
            _scale_bias(mixer.out_proj, c["ssm_out_multiplier"])
            if mixer.mamba_rms_norm:
                mixer.norm = GroupedGatedRMSNorm.of(mixer.norm)
        mx.eval(self.model.parameters())


@state_layer
def packed_falcon_h1_mixer(mixer: Any, inputs: mx.array, cache: StateLayerCache) -> mx.array:
    """mlx-lm's `FalconH1Mixer` over packed rows (`[T, 1, hidden]`): the packed Mamba-2 scan, then
    the gated RMSNorm (`mamba_rms_norm`) or the gate alone, then `out_proj`."""
    y, gate = packed_mamba2_scan(mixer, inputs, cache)
    y = mixer.norm(y, gate) if mixer.mamba_rms_norm else swiglu(gate, y)
    return mixer.out_proj(y)


class GroupedGatedRMSNorm(nn.Module):
    """transformers' `FalconH1RMSNormGated`: the gate (SiLU) before or after an RMSNorm taken over
    each of `n_groups` equal slices of the width."""

    def __init__(self, weight: mx.array, eps: float, n_groups: int, norm_before_gate: bool):
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.n_groups = n_groups
        self.norm_before_gate = norm_before_gate

    @classmethod
    def of(cls, norm: Any) -> GroupedGatedRMSNorm:
        """From mlx-lm's `FalconH1RMSNormGated` (its weight, epsilon, groups and order)."""
        return cls(norm.weight, norm.variance_epsilon, norm.n_groups, norm.norm_before_gate)

    def __call__(self, x: mx.array, gate: mx.array | None = None) -> mx.array:
        if gate is not None and not self.norm_before_gate:
            x = swiglu(gate, x)
        shape = x.shape
        grouped = x.reshape(*shape[:-1], self.n_groups, shape[-1] // self.n_groups)
        x = mx.fast.rms_norm(grouped, None, self.eps).reshape(shape) * self.weight
        if gate is not None and self.norm_before_gate:
            x = swiglu(gate, x)
        return x


def _scale_outputs(linear: Any, factor: float, *, bias: bool) -> None:
    """Multiply a linear layer's outputs by `factor` through its weight (a quantized layer's
    scales and offsets), and its bias too with `bias`."""
    if factor == 1:
        return
    if isinstance(linear, nn.QuantizedLinear):
        if getattr(linear, "mode", "affine") != "affine":
            raise ValueError(
                f"vllm-metal: Falcon-H1 layers quantized in mode {linear.mode!r} cannot be "
                "rescaled; serve an affine-quantized (mlx_lm.convert -q) or dense checkpoint"
            )
        linear.scales = linear.scales * factor
        if linear.get("biases") is not None:
            linear.biases = linear.biases * factor
    else:
        linear.weight = linear.weight * factor
    if bias:
        _scale_bias(linear, factor)


def _scale_bias(linear: Any, factor: float | mx.array) -> None:
    if "bias" in linear:
        linear.bias = linear.bias * factor
