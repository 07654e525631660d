"""What kind of memory each decoder layer needs: full attention, a sliding window, a latent (MLA)
cache, or a state.

Adapters report one `LayerKind` per memory layer (a module with KV memory of its own, named in the
adapter's `attention_layer_names`, in the same order); `vllm_metal.kv` turns them into vLLM
KV-cache specs. A decoder layer holds one memory layer in most models, none in some (Nemotron-H's
MLP-only and MoE-only blocks) and two in Falcon-H1, whose attention and Mamba-2 mixer run side by
side: the adapter names each and its `forward` hands each decoder layer its caches.
A state layer's shapes are read from the checkpoint's config by its model type (`STATE_SHAPES`),
both at startup (`kv.state.align_block_size`, before the model loads) and by the family adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

# The recurrent state is kept in float32 whatever the model's dtype.
RECURRENT_DTYPE = mx.float32


@dataclass(frozen=True)
class StateShapes:
    """One state layer's state: the short convolution's window and the recurrence's state."""

    conv: tuple[int, int]  # (kernel_size - 1, conv_dim), in the cache dtype
    # float32: Gated DeltaNet (num_v_heads, head_v_dim, head_k_dim); Mamba-2 (num_heads,
    # head_dim, state_size); () for a layer that is only a short convolution (LFM2)
    recurrent: tuple[int, ...]
    mixer: str = "gated_delta"  # "gated_delta", "mamba2" or "short_conv"

    def recurrent_bytes(self) -> int:
        return int(np.prod(self.recurrent)) * RECURRENT_DTYPE.size if self.recurrent else 0

    def page_bytes(self, conv_itemsize: int) -> int:
        return self.recurrent_bytes() + int(np.prod(self.conv)) * conv_itemsize


def gated_delta_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of a Qwen3-Next-style linear-attention layer, from its config.json fields."""
    num_k, num_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim = 2 * num_k * dk + num_v * dv
    return StateShapes(
        conv=(config["linear_conv_kernel_dim"] - 1, conv_dim), recurrent=(num_v, dv, dk)
    )


def kda_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of a Kimi Delta Attention layer (Kimi-Linear), from its `linear_attn_config`:
    one window over q, k and v side by side (vLLM's `kda_state_shape`) and a square state per
    head, decayed per key channel."""
    kda = config.get("linear_attn_config")
    if not kda:
        # transformers 5 writes `layer_types` and `linear_*` keys instead; vLLM's config class and
        # mlx-lm read the layer pattern and the KDA sizes from this dict alone.
        raise ValueError(
            "a Kimi-Linear config.json needs `linear_attn_config` (num_heads, head_dim, "
            "short_conv_kernel_size, kda_layers, full_attn_layers) as the published checkpoints "
            "have it; a config saved by transformers 5 alone lacks it"
        )
    heads, head_dim = kda["num_heads"], kda["head_dim"]
    return StateShapes(
        conv=(kda["short_conv_kernel_size"] - 1, 3 * heads * head_dim),
        recurrent=(heads, head_dim, head_dim),
    )


def _mamba2(heads: int, head_dim: int, groups: int, state_size: int, kernel: int) -> StateShapes:
    """A Mamba-2 layer's state: the conv window over x, B and C, and the heads' SSM states."""
    conv_dim = heads * head_dim + 2 * groups * state_size
    return StateShapes(
        conv=(kernel - 1, conv_dim), recurrent=(heads, head_dim, state_size), mixer="mamba2"
    )


def mamba2_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of a Granite 4.0-H-style Mamba-2 layer, from its config.json fields."""
    return _mamba2(
        config["mamba_n_heads"],
        config["mamba_d_head"],
        config["mamba_n_groups"],
        config["mamba_d_state"],
        config["mamba_d_conv"],
    )


def nemotron_h_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of a Nemotron-H Mamba-2 layer, from its config.json fields."""
    return _mamba2(
        config["mamba_num_heads"],
        config["mamba_head_dim"],
        config["n_groups"],
        config["ssm_state_size"],
        config["conv_kernel"],
    )


def falcon_h1_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of a Falcon-H1 layer's Mamba-2 mixer, from its config.json fields (its width is
    `mamba_d_ssm`, or `mamba_expand` x the hidden size; the head size may be "auto": the width
    over the heads)."""
    heads = config["mamba_n_heads"]
    head_dim = config["mamba_d_head"]
    if head_dim == "auto":
        width = config.get("mamba_d_ssm") or config["mamba_expand"] * config["hidden_size"]
        head_dim = width // heads
    return _mamba2(
        heads, head_dim, config["mamba_n_groups"], config["mamba_d_state"], config["mamba_d_conv"]
    )


def short_conv_state_shapes(config: Mapping[str, Any]) -> StateShapes:
    """The state of an LFM2 short-convolution layer (its window of gated inputs alone), from its
    config.json fields."""
    return StateShapes(
        conv=(config["conv_L_cache"] - 1, config["hidden_size"]), recurrent=(), mixer="short_conv"
    )


# model_type -> the state of each of its state layers (all alike within a model).
STATE_SHAPES = {
    "qwen3_next": gated_delta_state_shapes,
    # Qwen3.5 / 3.6: the wrappers' model types (their `text_config`) and the text models'.
    **dict.fromkeys(
        ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"), gated_delta_state_shapes
    ),
    "granitemoehybrid": mamba2_state_shapes,
    "nemotron_h": nemotron_h_state_shapes,
    "falcon_h1": falcon_h1_state_shapes,
    "lfm2": short_conv_state_shapes,
    "kimi_linear": kda_state_shapes,
}


def state_shapes_of(model_type: str, config: Mapping[str, Any]) -> StateShapes:
    if model_type not in STATE_SHAPES:
        raise ValueError(
            f"model_type={model_type!r} has state (recurrent) layers vllm-metal does not "
            f"implement; hybrid models supported: {', '.join(sorted(STATE_SHAPES))}"
        )
    return STATE_SHAPES[model_type](config)


@dataclass(frozen=True)
class LayerKind:
    sliding_window: int | None = None  # attends to the last W keys (None = the whole context)
    is_state: bool = False  # recurrent state instead of a KV cache (Mamba, Gated DeltaNet)
    state: StateShapes | None = None  # the state's shapes, where the family declares them
    # Multi-head latent attention: one compressed row per token serves as every head's key and
    # value (no separate values, `kv.latent`).
    latent: bool = False
    # An attention layer's own KV heads and head size where they differ from the model's (Gemma 4's
    # full-attention layers; a latent layer's one head of latent width, `families.deepseek_v3`);
    # None: the model's (`ModelConfig.get_num_kv_heads / get_head_size`).
    num_kv_heads: int | None = None
    head_dim: int | None = None
    # The earlier layer whose keys and values this layer attends over, writing none of its own
    # (Gemma 4's `num_kv_shared_layers`): it has no KV memory, no spec, and reads the source's.
    kv_source: int | None = None

    @property
    def label(self) -> str:
        if self.is_state:
            return "state"
        if self.latent:
            return "latent"
        label = "full" if self.sliding_window is None else f"sliding({self.sliding_window})"
        if self.head_dim is not None:
            label += f" {self.num_kv_heads}x{self.head_dim}"
        if self.kv_source is not None:
            label += f" reading layer {self.kv_source}"
        return label

    def kv_shape(self, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
        """(KV heads, head size) of an attention layer, given the model's."""
        return (self.num_kv_heads or num_kv_heads, self.head_dim or head_dim)


FULL_ATTENTION = LayerKind()
STATE = LayerKind(is_state=True)
LATENT = LayerKind(latent=True)


def memory_layers(kinds: Sequence[LayerKind]) -> list[int]:
    """Per layer, the index of the layer whose KV memory it uses: its own, or its `kv_source`'s."""
    return [i if kind.kv_source is None else kind.kv_source for i, kind in enumerate(kinds)]


def kinds_from_caches(caches: list[Any]) -> list[LayerKind]:
    """Layer kinds from mlx-lm's own `make_cache()` declaration of a model."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    kinds = []
    for cache in caches:
        if isinstance(cache, RotatingKVCache) and not cache.keep:
            kinds.append(LayerKind(sliding_window=int(cache.max_size)))
        elif type(cache) is KVCache:
            kinds.append(FULL_ATTENTION)
        else:
            kinds.append(STATE)
    return kinds


def kinds_from_config(config: Mapping[str, Any], num_layers: int) -> list[LayerKind]:
    """Layer kinds as transformers applies a checkpoint's `sliding_window` / `layer_types`.

    For families whose mlx-lm class does not declare its windows through `make_cache()`.
    """
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if not window:
        return [FULL_ATTENTION] * num_layers
    sliding = LayerKind(sliding_window=int(window))
    if layer_types:
        kinds = [sliding if t == "sliding_attention" else FULL_ATTENTION for t in layer_types]
        return kinds[:num_layers]
    if config.get("use_sliding_window", True) is False:
        return [FULL_ATTENTION] * num_layers
    return [sliding] * num_layers
