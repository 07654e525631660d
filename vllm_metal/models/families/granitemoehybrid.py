"""Granite 4.0-H: Mamba-2 layers between attention layers, MoE blocks beside a shared MLP, and
Granite's embedding, residual, attention and logit multipliers. mlx-lm's decoder takes no input
embeddings (it scales them itself), and its Mamba-2 mixer keeps a dense per-batch state; here the
mixer reads and writes its requests' state pages (`kv.state.StateLayerCache`) and runs the packed
ops `ops.causal_conv1d` and `ops.mamba2_scan` over the step's varlen batch. The attention layers
go through the paged attention like any mlx-lm family. Mirrors mlx-lm 0.32.2
(`models/granitemoehybrid.py`, `models/ssm.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.granitemoehybrid import GraniteMoeHybridMamba2Mixer
from mlx_lm.models.ssm import compute_dt

from vllm_metal import ops
from vllm_metal.compat.mlx_lm_attention import patch_attention_class
from vllm_metal.kv.state import StateLayerCache, state_layer
from vllm_metal.models.adapter import ModelAdapter

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("granitemoehybrid",)
KIND = "state_hybrid"
MODALITIES: tuple[str, ...] = ()


class Adapter(ModelAdapter):
    def install_paged_attention(self) -> None:
        super().install_paged_attention()
        patch_attention_class(GraniteMoeHybridMamba2Mixer, packed_mamba2_mixer, StateLayerCache)

    def forward(self, input_embeds: mx.array, caches: list[Any]) -> mx.array:
        # GraniteMoeHybridModel.__call__, which scales the embeddings first.
        return self.decode_layers(input_embeds * self.decoder.embedding_multiplier, caches)


@state_layer
def packed_mamba2_mixer(mixer: Any, inputs: mx.array, cache: StateLayerCache) -> mx.array:
    """The mixer over packed rows (`[T, 1, hidden]`, each row one token of some request): mlx-lm's
    Mamba-2 mixers of Granite 4.0-H and Nemotron-H, which share their layout (`in_proj` to gate,
    conv input and dt; a depthwise conv; the scan; a gated RMSNorm; `out_proj`)."""
    y, gate = packed_mamba2_scan(mixer, inputs, cache)
    return mixer.out_proj(mixer.norm(y, gate))


def packed_mamba2_scan(
    mixer: Any, inputs: mx.array, cache: StateLayerCache
) -> tuple[mx.array, mx.array]:
    """A Mamba-2 mixer up to its gate over packed rows: the scan's output and the gate, both
    `[T, 1, intermediate]`, each request's window and state carried in its pages. Reads mlx-lm's
    mixer attributes (`in_proj`, `conv1d`, `dt_bias`, `time_step_limit`, `A_log`, `D` and the
    sizes), which Granite 4.0-H, Nemotron-H and Falcon-H1 share."""
    t = inputs.shape[0]
    heads, head_dim = mixer.num_heads, mixer.head_dim
    groups, state_size = mixer.n_groups, mixer.ssm_state_size
    inner = mixer.intermediate_size
    gate, conv_input, dt = mx.split(
        mixer.in_proj(inputs).reshape(t, -1), [inner, inner + mixer.conv_dim], axis=-1
    )
    window, state = cache.read()
    bias = mixer.conv1d.bias if "bias" in mixer.conv1d else None
    conv_out, window = ops.causal_conv1d(
        conv_input,
        mixer.conv1d.weight[:, :, 0],
        window,
        cache.cu_seqlens,
        bias,
        max_query_len=cache.query_rows,
    )
    x, B, C = mx.split(conv_out, [inner, inner + groups * state_size], axis=-1)
    y, state = ops.mamba2_scan(
        x.reshape(t, heads, head_dim),
        compute_dt(dt, mixer.dt_bias, mixer.time_step_limit),
        -mx.exp(mixer.A_log.astype(mx.float32)),
        B.reshape(t, groups, state_size),
        C.reshape(t, groups, state_size),
        mixer.D.astype(mx.float32),
        state,
        cache.cu_seqlens,
        cache.query_rows,
    )
    cache.write(window, state)
    return y.reshape(t, 1, inner), gate.reshape(t, 1, inner)
