"""GPT-OSS: attention sinks, alternating sliding-window (128) and full layers, a top-k MoE with a
clamped SwiGLU. Mirrors mlx-lm 0.32.2 (`models/gpt_oss.py`) and transformers' `GptOssForCausalLM`.

What the generic adapter already does right: mlx-lm's attention calls the module's
`scaled_dot_product_attention(..., sinks=self.sinks)`, which `compat/mlx_lm_attention.py` routes to the
paged op with the sinks; `make_cache()` declares the sliding layers (`RotatingKVCache` of
`sliding_window`), so they get vLLM's `SlidingWindowSpec`; the MoE runs mlx-lm's `SwitchGLU` over
the step's packed rows. What this module adds:
- `sanitize`: mlx-lm reads only the MXFP4 expert layout of the published checkpoints
  (`*_blocks` / `*_scales`); a dense (bf16 / float32) checkpoint keeps transformers' fused,
  transposed experts (`gate_up_proj [E, hidden, 2 * inter]`, gate and up interleaved;
  `down_proj [E, inter, hidden]`), which mlx-lm refuses ("parameters not in model").
- YaRN with `truncate: false` (the released configs): mlx-lm always rounds the correction range
  to whole dimensions, transformers and vLLM do not, so the frequencies are recomputed; and a
  YaRN given only in transformers 5's `rope_parameters` (mlx-lm reads `rope_scaling`) is built.
- `swiglu_alpha` / `swiglu_limit` from the config (mlx-lm hard-codes 1.702 and 7.0).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("gpt_oss",)
KIND = "moe"
MODALITIES: tuple[str, ...] = ()


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Dense HF expert tensors -> mlx-lm's `SwitchGLU` parameters (`gate_proj`, `up_proj`,
    `down_proj`, each `[E, out, in]` with its bias). Other layouts pass through unchanged."""
    if not any(k.endswith("mlp.experts.gate_up_proj") for k in weights):
        return weights
    out = {}
    for key, value in weights.items():
        prefix, _, name = key.rpartition(".")
        if not prefix.endswith("mlp.experts"):
            out[key] = value
        elif name == "gate_up_proj":  # [E, hidden, 2 * inter] -> rows of [E, 2 * inter, hidden]
            rows = value.swapaxes(-1, -2)
            out[f"{prefix}.gate_proj.weight"] = mx.contiguous(rows[..., ::2, :])
            out[f"{prefix}.up_proj.weight"] = mx.contiguous(rows[..., 1::2, :])
        elif name == "gate_up_proj_bias":
            out[f"{prefix}.gate_proj.bias"] = mx.contiguous(value[..., ::2])
            out[f"{prefix}.up_proj.bias"] = mx.contiguous(value[..., 1::2])
        elif name == "down_proj":  # [E, inter, hidden] -> [E, hidden, inter]
            out[f"{prefix}.down_proj.weight"] = mx.contiguous(value.swapaxes(-1, -2))
        elif name == "down_proj_bias":
            out[f"{prefix}.down_proj.bias"] = value
        else:
            out[key] = value
    return out


def yarn_frequencies(head_dim: int, base: float, scaling: dict[str, Any]) -> mx.array:
    """The wavelengths mlx-lm's `YarnRoPE` takes as `freqs`, computed as transformers'
    `_compute_yarn_parameters` does (the correction range rounded only with `truncate`)."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = mx.clip((mx.arange(head_dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    pos = base ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    inv_freq = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
    return 1.0 / inv_freq


class Adapter(ModelAdapter):
    def __init__(self, model: Any, config: dict[str, Any]):
        super().__init__(model, config)
        self._match_transformers()

    def _match_transformers(self) -> None:
        from mlx_lm.models.rope_utils import YarnRoPE, initialize_rope

        scaling = self.config.get("rope_scaling")
        params = self.config.get("rope_parameters")
        # A transformers 5 config keeps the scaling only in `rope_parameters`, which mlx-lm does
        # not read (it then builds a plain RoPE).
        rebuild = not scaling and isinstance(params, dict) and "factor" in params
        if rebuild:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling = scaling or {}
        base = float(self.config.get("rope_theta", 150000))
        alpha = self.config.get("swiglu_alpha")
        limit = self.config.get("swiglu_limit")
        for layer in self.model.layers:
            attn = layer.self_attn
            if rebuild:
                attn.rope = initialize_rope(attn.head_dim, base, False, scaling_config=scaling)
            if isinstance(attn.rope, YarnRoPE) and scaling.get("truncate") is False:
                attn.rope._freqs = yarn_frequencies(attn.rope.dims, base, scaling)
            activation = layer.mlp.experts.activation
            if alpha is not None:
                activation._alpha = float(alpha)
            if limit is not None:
                activation._limit = float(limit)
