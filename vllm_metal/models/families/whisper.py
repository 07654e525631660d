"""Whisper in MLX: an audio encoder run once per request and a text decoder on the paged KV cache.

The module tree mirrors transformers' `WhisperForConditionalGeneration`, so a Hugging Face
checkpoint's tensor names are this tree's parameter names (`model.encoder.conv1.weight`,
`model.decoder.layers.0.encoder_attn.q_proj.weight`, ...); only the convolutions are transposed
to MLX's `[out, kernel, in]` layout, and the head is the token embedding (`proj_out` is tied).

The encoder maps log-mel features `[N, n_mels, 3000]` to states `[N, 1500, d_model]` with
bidirectional attention. Each decoder layer has two attention blocks, both on the paged pool:
self-attention over the request's tokens (a `PagedLayerCache` of the self-attention group) and
cross-attention over the encoder states, whose K/V are written into the cross-attention group's
blocks on the request's first step and read by every later one. The cross-attention view is a
`PagedLayerCache` too, whose metadata makes each decoder token a one-query sequence over its
request's encoder positions (built by the speech runner). The
decoder adds learned positions; layers are pre-LN with GELU MLPs, as in the original.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from vllm_metal.kv.paged_cache import PagedLayerCache
from vllm_metal.models.families.bert import ACTIVATIONS
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind
from vllm_metal.models.loaders import load_strict, parameter_bytes, read_safetensors

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("whisper",)
KIND = "speech_to_text"
MODALITIES: tuple[str, ...] = ("audio",)

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which transformers' Whisper uses
_CONVS = ("model.encoder.conv1.weight", "model.encoder.conv2.weight")


@dataclass(frozen=True)
class WhisperArgs:
    """The config.json fields Whisper reads."""

    vocab_size: int
    d_model: int
    num_mel_bins: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    max_source_positions: int
    max_target_positions: int
    activation_function: str = "gelu"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WhisperArgs:
        act = config.get("activation_function", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(
                f"activation_function {act!r} is not supported; choose from {sorted(ACTIVATIONS)}"
            )
        fields = [f for f in cls.__dataclass_fields__ if f != "activation_function"]
        missing = [f for f in fields if f not in config]
        if missing:
            raise ValueError(f"a Whisper config.json needs {missing}")
        return cls(**{f: int(config[f]) for f in fields}, activation_function=act)

    @property
    def decoder_head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads


class Attention(nn.Module):
    """Multi-head attention with Whisper's projections (no bias on the key projection)."""

    def __init__(self, dims: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dims // num_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(dims, dims)
        self.k_proj = nn.Linear(dims, dims, bias=False)
        self.v_proj = nn.Linear(dims, dims)
        self.out_proj = nn.Linear(dims, dims)

    def heads(self, x: mx.array) -> mx.array:
        """`[..., dims]` -> `[..., num_heads, head_dim]`."""
        return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

    def encoder_attention(self, x: mx.array) -> mx.array:
        """Bidirectional self-attention over a batch `[N, L, dims]`."""
        q, k, v = (self.heads(p(x)).transpose(0, 2, 1, 3) for p in self._projections)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(x.shape))

    def paged_attention(self, x: mx.array, cache: PagedLayerCache) -> mx.array:
        """Causal self-attention of packed tokens `[T, dims]`, writing their K/V into `cache`."""
        q, k, v = (self.heads(p(x))[:, :, None] for p in self._projections)  # [T, H, 1, D]
        cache.update_and_fetch(k, v)
        return self.out_proj(cache.attend(q, self.scale, None).reshape(x.shape))

    def cross_attention(
        self, x: mx.array, cache: PagedLayerCache, encoder_states: mx.array | None
    ) -> mx.array:
        """Attention of packed tokens `[T, dims]` over their requests' encoder states (every
        position: `cache` treats each token as a one-query sequence); the states of requests
        encoded this step (`[E, dims]`) are projected and written first."""
        if encoder_states is not None:
            k = self.heads(self.k_proj(encoder_states))[:, :, None]
            v = self.heads(self.v_proj(encoder_states))[:, :, None]
            cache.update_and_fetch(k, v)
        q = self.heads(self.q_proj(x))[:, :, None]
        return self.out_proj(cache.attend(q, self.scale, None).reshape(x.shape))

    @property
    def _projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj


class EncoderLayer(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        dims = args.d_model
        self.self_attn = Attention(dims, args.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(dims, args.encoder_ffn_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_dim, dims)
        self.final_layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)
        self.act = ACTIVATIONS[args.activation_function]

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn.encoder_attention(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        dims = args.d_model
        self.conv1 = nn.Conv1d(args.num_mel_bins, dims, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dims, dims, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(args.max_source_positions, dims)
        self.layers = [EncoderLayer(args) for _ in range(args.encoder_layers)]
        self.layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)

    def __call__(self, features: mx.array) -> mx.array:
        """`[N, n_mels, frames]` log-mel features -> `[N, frames // 2, d_model]` states."""
        x = nn.gelu(self.conv1(features.transpose(0, 2, 1)))
        x = nn.gelu(self.conv2(x))
        length = x.shape[1]
        if length > self.embed_positions.weight.shape[0]:
            raise ValueError(
                f"input_features has {features.shape[2]} frames; this Whisper encodes at most "
                f"{2 * self.embed_positions.weight.shape[0]}"
            )
        x = x + self.embed_positions.weight[:length]
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        dims = args.d_model
        self.self_attn = Attention(dims, args.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)
        self.encoder_attn = Attention(dims, args.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(dims, args.decoder_ffn_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_dim, dims)
        self.final_layer_norm = nn.LayerNorm(dims, eps=LAYER_NORM_EPS)
        self.act = ACTIVATIONS[args.activation_function]

    def __call__(
        self,
        x: mx.array,
        cache: PagedLayerCache,
        cross: PagedLayerCache,
        encoder_states: mx.array | None,
    ) -> mx.array:
        x = x + self.self_attn.paged_attention(self.self_attn_layer_norm(x), cache)
        x = x + self.encoder_attn.cross_attention(
            self.encoder_attn_layer_norm(x), cross, encoder_states
        )
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class TextDecoder(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.d_model)
        self.embed_positions = nn.Embedding(args.max_target_positions, args.d_model)
        self.layers = [DecoderLayer(args) for _ in range(args.decoder_layers)]
        self.layer_norm = nn.LayerNorm(args.d_model, eps=LAYER_NORM_EPS)


class WhisperModel(nn.Module):
    def __init__(self, args: WhisperArgs):
        super().__init__()
        self.encoder = AudioEncoder(args)
        self.decoder = TextDecoder(args)


class Whisper(nn.Module):
    """`WhisperForConditionalGeneration`'s tree (its `proj_out` is the tied embedding)."""

    def __init__(self, args: WhisperArgs):
        super().__init__()
        self.args = args
        self.model = WhisperModel(args)


class WhisperAdapter:
    """The speech runner's view of Whisper: encode, decode over the paged pool, logits."""

    def __init__(self, model: Whisper, config: dict[str, Any]):
        self.model = model
        self.config = config
        self.args = model.args
        self.model_type = "whisper"

    @property
    def weight_bytes(self) -> int:
        return parameter_bytes(self.model)

    @property
    def num_layers(self) -> int:
        return self.args.decoder_layers

    @property
    def num_kv_heads(self) -> int:
        return self.args.decoder_attention_heads

    @property
    def head_dim(self) -> int:
        return self.args.decoder_head_dim

    @property
    def encoder_length(self) -> int:
        """Encoder states per request (1500 for 30 s of audio)."""
        return self.args.max_source_positions

    @property
    def attention_layer_names(self) -> list[str]:
        return [f"model.decoder.layers.{i}.self_attn" for i in range(self.num_layers)]

    @property
    def cross_attention_layer_names(self) -> list[str]:
        return [f"model.decoder.layers.{i}.encoder_attn" for i in range(self.num_layers)]

    def layer_kinds(self) -> list[LayerKind]:
        return [FULL_ATTENTION] * self.num_layers

    def encode(self, features: mx.array) -> mx.array:
        """`[N, n_mels, frames]` -> encoder states `[N, L, d_model]`."""
        return self.model.model.encoder(features.astype(self._dtype))

    def decode(
        self,
        token_ids: mx.array,
        positions: mx.array,
        caches: list[PagedLayerCache],
        cross: list[PagedLayerCache],
        encoder_states: mx.array | None,
    ) -> mx.array:
        """Final hidden states `[T, d_model]` of packed decoder tokens. `encoder_states`
        (`[E, d_model]`, the states of this step's newly encoded requests, packed in the
        order of the cross caches' slot mapping) are written into the cross-attention K/V."""
        decoder = self.model.model.decoder
        x = decoder.embed_tokens(token_ids) + decoder.embed_positions(positions)
        for layer, cache, cross_cache in zip(decoder.layers, caches, cross):
            x = layer(x, cache, cross_cache, encoder_states)
        return decoder.layer_norm(x)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.model.model.decoder.embed_tokens.as_linear(hidden)

    @property
    def _dtype(self) -> mx.Dtype:
        return self.model.model.decoder.embed_tokens.weight.dtype


def load(path: Path, config: dict[str, Any], compute_dtype: mx.Dtype) -> WhisperAdapter:
    """Build Whisper for `config` and load the Hugging Face checkpoint at `path` strictly."""
    model = Whisper(WhisperArgs.from_config(config))
    tensors = read_safetensors(path)
    tied = tensors.pop("proj_out.weight", None)
    embed = tensors.get("model.decoder.embed_tokens.weight")
    if tied is not None and embed is not None and not mx.array_equal(tied[0], embed[0]):
        raise ValueError(f"{path}: proj_out.weight differs from the token embedding (untied)")
    for name in _CONVS:
        if name in tensors:
            value, file = tensors[name]
            tensors[name] = (value.transpose(0, 2, 1), file)  # [out, in, k] -> [out, k, in]
    load_strict(model, tensors, path=path, what="Whisper", dtype_of=lambda _: compute_dtype)
    return WhisperAdapter(model, config)
