"""LFM2 / LFM2.5 (`lfm2`): gated short-convolution layers between attention layers. A
convolution layer projects each token to B, C and x, convolves B * x over a window of the last
`conv_L_cache` tokens (depthwise, no activation) and gates the result by C. On the MLX runner the
window lives in the request's state pages (`kv.state`, a state with no recurrent part) and the
convolution runs over the packed step (`ops.causal_conv1d` without SiLU); the attention layers go
through the paged attention like any mlx-lm family. Mirrors mlx-lm 0.32.2 (`models/lfm2.py`).
"""

from __future__ import annotations

from functools import cached_property

import mlx.core as mx
from mlx_lm.models.lfm2 import ShortConv

from vllm_metal import ops
from vllm_metal.compat import mlx_lm_attention as attention
from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind, state_shapes_of

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("lfm2",)
KIND = "short_conv_hybrid"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    @cached_property
    def attention_layer_names(self) -> list[str]:
        return [
            f"model.layers.{i}.{'self_attn' if layer.is_attention_layer else 'conv'}"
            for i, layer in enumerate(self.model.layers)
        ]

    def layer_kinds(self) -> list[LayerKind]:
        state = LayerKind(is_state=True, state=state_shapes_of(self.model_type, self.config))
        return [
            FULL_ATTENTION if layer.is_attention_layer else state for layer in self.model.layers
        ]

    def install_paged_attention(self) -> None:
        super().install_paged_attention()
        attention.patch_attention_class(ShortConv, _packed_short_conv, StateLayerCache)


@state_layer
def _packed_short_conv(layer: ShortConv, inputs: mx.array, cache: StateLayerCache) -> mx.array:
    """The layer over packed rows (`[T, 1, hidden]`, each row one token of some request)."""
    t = inputs.shape[0]
    gate_in, gate_out, x = mx.split(layer.in_proj(inputs).reshape(t, -1), 3, axis=-1)
    window, none = cache.read()  # no recurrent state
    bias = layer.conv.bias if "bias" in layer.conv else None
    conv_out, window = ops.causal_conv1d(
        gate_in * x,
        layer.conv.weight[:, :, 0],
        window,
        cache.cu_seqlens,
        bias,
        silu=False,
        max_query_len=cache.query_rows,
    )
    cache.write(window, none)
    return layer.out_proj((gate_out * conv_out).reshape(t, 1, -1))
