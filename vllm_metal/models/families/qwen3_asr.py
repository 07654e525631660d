"""Qwen3-ASR (`qwen3_asr`): its audio encoder and projector in MLX, as transformers'
`Qwen3ASREncoder` and `Qwen3ASRMultiModalProjector` compute them.

A clip's log-mel features `[num_mel_bins, frames]` are cut into chunks of `2 * n_window` frames
(the last one zero-padded); three stride-2 convolutions shrink each chunk to at most 13 rows,
which get a sinusoidal position within their chunk. The valid rows of all chunks are packed, and
the transformer layers attend both ways inside windows of `n_window_infer` frames' worth of rows.
The projector maps each row to one audio placeholder token's embedding of the Qwen3 decoder.

The language model is mlx-lm's `qwen3` over the checkpoint's `text_config` (lifted to the top
by `models/hf_config.py`; `sanitize` maps `model.language_model.*` to mlx-lm's names), paged like
any decoder; the tower sits beside it (`load_towers`) and the runner's multimodal kind writes a
clip's rows over its placeholder tokens. vLLM's side (processor, transcription prompt) is
`compat/qwen3_asr.py`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.multimodal import MultimodalAdapter, TokenRows

MODEL_TYPES = ("qwen3_asr",)
KIND = "audio_language"
MODALITIES = ("audio",)
# mlx-lm reads the language model as a plain Qwen3.
MLX_LM_MODULES = {"qwen3_asr": "qwen3"}
_LANGUAGE_MODEL = "model.language_model."

# The stride-2 convolutions of the tower's downsampling stack.
_CONVOLUTIONS = 3


def post_conv_length(frames: int) -> int:
    """Rows a chunk of `frames` mel frames keeps after the three (k=3, s=2, p=1) convolutions."""
    for _ in range(_CONVOLUTIONS):
        frames = (frames - 1) // 2 + 1 if frames > 0 else 0
    return frames


def output_length(frames: int, n_window: int = 50) -> int:
    """Encoder rows (= audio placeholder tokens) of a clip of `frames` mel frames."""
    chunk = 2 * n_window
    full, rest = divmod(frames, chunk)
    return full * post_conv_length(chunk) + post_conv_length(rest)


def _sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> mx.array:
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = mx.exp(-increment * mx.arange(channels // 2, dtype=mx.float32))
    scaled = mx.arange(length, dtype=mx.float32)[:, None] * inv_timescales[None, :]
    return mx.concatenate([mx.sin(scaled), mx.cos(scaled)], axis=1)


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim, bias=True)
        self.k_proj = nn.Linear(dim, dim, bias=True)
        self.v_proj = nn.Linear(dim, dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        rows = x.shape[0]

        def heads(t: mx.array) -> mx.array:
            return t.reshape(rows, self.num_heads, -1).transpose(1, 0, 2)[None]

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out[0].transpose(1, 0, 2).reshape(rows, -1))


class _EncoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, ffn_dim: int):
        super().__init__()
        self.self_attn = _Attention(dim, num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.self_attn(self.self_attn_layer_norm(x), mask)
        return x + self.fc2(nn.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """transformers' `Qwen3ASREncoder` (parameter names as its checkpoint's `audio_tower.*`)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        if config.get("activation_function", "gelu") != "gelu":
            raise ValueError(f"Qwen3-ASR encoder: activation {config['activation_function']!r}")
        dim, channels = config["d_model"], config["downsample_hidden_size"]
        mels = config["num_mel_bins"]
        self.n_window = config["n_window"]
        self.n_window_infer = config["n_window_infer"]
        self.conv2d1 = nn.Conv2d(1, channels, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(channels, channels, 3, 2, padding=1)
        freq_bins = post_conv_length(mels)
        self.conv_out = nn.Linear(channels * freq_bins, dim, bias=False)
        self.layers = [
            _EncoderLayer(dim, config["encoder_attention_heads"], config["encoder_ffn_dim"])
            for _ in range(config["encoder_layers"])
        ]
        self.ln_post = nn.LayerNorm(dim)
        self._positions = _sinusoids(config.get("max_position_embeddings", 13), dim)

    def _windows(self, chunk_rows: list[int]) -> list[int]:
        """Row counts of the attention windows: `n_window_infer` frames' worth of the longest
        chunk's rows each, the last one shorter."""
        window = max(chunk_rows) * (self.n_window_infer // (2 * self.n_window))
        total = sum(chunk_rows)
        return [window] * (total // window) + ([total % window] if total % window else [])

    def __call__(self, features: mx.array) -> mx.array:
        """`features [num_mel_bins, frames]` of one clip -> `[output_length(frames), d_model]`."""
        mels, frames = features.shape
        chunk = 2 * self.n_window
        num_chunks = max(1, -(-frames // chunk))
        padded = mx.pad(features, [(0, 0), (0, num_chunks * chunk - frames)])
        # [chunks, mels, chunk frames, 1]: MLX convolves channels-last (NHWC).
        x = padded.reshape(mels, num_chunks, chunk).transpose(1, 0, 2)[..., None]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = nn.gelu(conv(x))
        n, freq, steps, channels = x.shape
        # transformers flattens (channel, frequency) per time step.
        x = x.transpose(0, 2, 3, 1).reshape(n, steps, channels * freq)
        x = self.conv_out(x) + self._positions[:steps].astype(x.dtype)
        chunk_frames = [chunk] * (num_chunks - 1) + [frames - (num_chunks - 1) * chunk]
        chunk_rows = [post_conv_length(f) for f in chunk_frames]
        x = mx.concatenate([x[i, :rows] for i, rows in enumerate(chunk_rows) if rows])
        window_ids = mx.concatenate(
            [
                mx.full((rows,), i, dtype=mx.int32)
                for i, rows in enumerate(self._windows(chunk_rows))
            ]
        )
        mask = (window_ids[:, None] == window_ids[None, :])[None, None]
        for layer in self.layers:
            x = layer(x, mask)
        return self.ln_post(x)


class Projector(nn.Module):
    """transformers' `Qwen3ASRMultiModalProjector`: d_model -> d_model -> output_dim."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.linear_1 = nn.Linear(config["d_model"], config["d_model"])
        self.linear_2 = nn.Linear(config["d_model"], config["output_dim"])

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(nn.gelu(self.linear_1(x)))


class AudioTower(nn.Module):
    """The encoder and projector: a clip's features -> its placeholder tokens' embeddings."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.audio_tower = AudioEncoder(config)
        self.multi_modal_projector = Projector(config)

    def __call__(self, features: mx.array) -> mx.array:
        return self.multi_modal_projector(self.audio_tower(features))


def tower_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The tower's tensors of a transformers-layout checkpoint (`model.audio_tower.*`,
    `model.multi_modal_projector.*`), convolution kernels laid out for MLX."""
    out = {}
    for name, value in weights.items():
        if not name.startswith(("model.audio_tower.", "model.multi_modal_projector.")):
            continue
        key = name.removeprefix("model.")
        if key.startswith("audio_tower.conv2d") and key.endswith(".weight") and value.ndim == 4:
            value = value.transpose(0, 2, 3, 1)  # [out, in, kh, kw] -> [out, kh, kw, in]
        out[key] = value
    return out


def load_tower(path: str | Path, config: dict[str, Any], dtype: mx.Dtype) -> AudioTower:
    """The audio tower of the checkpoint in `path` (`config`: its config.json), in `dtype`."""
    tower = AudioTower(config["audio_config"])
    weights: dict[str, mx.array] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        weights |= tower_weights(mx.load(str(file)))
    tower.load_weights([(k, v.astype(dtype)) for k, v in weights.items()], strict=True)
    mx.eval(tower.parameters())
    return tower.eval()


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The language model's tensors under mlx-lm's `qwen3` names; the tower's are left out."""
    out = {}
    for name, value in weights.items():
        if name.startswith(_LANGUAGE_MODEL):
            out["model." + name.removeprefix(_LANGUAGE_MODEL)] = value
        elif name.startswith("lm_head."):
            out[name] = value
    return out


class Adapter(MultimodalAdapter):
    """mlx-lm's Qwen3 decoder with the audio tower beside it."""

    modalities = MODALITIES
    transcribes = True  # vLLM's `/v1/audio/transcriptions` (`MultimodalState.generation_tasks`)

    def __init__(self, model: Any, config: dict[str, Any], _vision_config: Any = None):
        super().__init__(model, config)
        self.tower: AudioTower | None = None
        self.dtype = mx.float32

    language_model = property(lambda self: self.model)
    decoder = property(lambda self: self.model.model)
    num_layers = property(lambda self: len(self.model.layers))

    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
    ) -> mx.array:
        # One position stream: audio tokens are placed as text is (transformers' Qwen3ASR).
        return ModelAdapter.forward(self, input_embeds, caches)

    def load_towers(self, path: Path, config: dict[str, Any], compute_dtype: mx.Dtype) -> None:
        self.dtype = compute_dtype
        self.tower = load_tower(path, config, compute_dtype)

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        if self.tower is None or modality != "audio":
            raise ValueError(f"{self.model_type} encodes audio, not {modality}")
        return [
            self.tower(mx.array(item["input_audio_features"]).astype(self.dtype)) for item in items
        ]
