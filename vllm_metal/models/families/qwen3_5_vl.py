"""Qwen3.5 / 3.6 with their vision tower (the published `Qwen3_5ForConditionalGeneration` and
`Qwen3_5MoeForConditionalGeneration`): the state-hybrid language model of `families.qwen3_5`
(Gated DeltaNet layers on vLLM's state pages), mlx-vlm's `qwen3_5` ViT for images and video, and
interleaved M-RoPE positions on the full-attention layers.

The tower is Qwen3-VL's without DeepStack (mlx-vlm 0.7.10, `models/qwen3_5/vision.py`); items,
placeholders and M-RoPE placement are Qwen3-VL's (`families.qwen3_vl`): an image is one run of
`t*h*w / 4` `<|image_pad|>` tokens, a video one timestamped run per grid step. Only the full
attention layers rotate (a quarter of each head, `partial_rotary_factor`); transformers'
`Qwen3_5TextRotaryEmbedding` gives rotary frequency `j` the height stream's position where
`j % 3 == 1` and `j < 3 * mrope_section[1]`, the width stream's where `j % 3 == 2` and
`j < 3 * mrope_section[2]`, the temporal stream's elsewhere. Text tokens sit at the same
position on all three streams, where this is Qwen3.5's plain RoPE.

Served where vLLM's own Qwen3.5 processor imports (`compat.vllm_models.uses_vllm_processor`):
elsewhere (Linux, without torchvision) `config.multimodal` sets `language_model_only` and the
language model alone is served by `families.qwen3_5`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from vllm_metal.models.families import qwen3_5
from vllm_metal.models.families.qwen2_5_vl import Grid, encode_items, place_tokens
from vllm_metal.models.families.qwen3_vl import timestamped_runs
from vllm_metal.models.multimodal import MultimodalAdapter, TokenRows

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
KIND = "vision_state_hybrid"
MODALITIES: tuple[str, ...] = ("image", "video")

# Tensor-name prefixes of the tower: Hugging Face's layout, then mlx-vlm's converted one.
_TOWER_PREFIXES = ("model.visual.", "vision_tower.")


def towers_run() -> bool:
    """Whether vLLM prepares this family's images and videos here (its processor imports)."""
    from vllm_metal.compat.vllm_models import uses_vllm_processor

    return uses_vllm_processor("qwen3_5")


class InterleavedMRoPE(nn.Module):
    """Qwen3.5's rotary embedding of the first `dims` features of each head, at the positions of
    the step's three streams (`positions`, `[3, T, 1]`, set before each forward); packed rows are
    `[T, heads, 1, head_dim]`, one token each."""

    def __init__(self, dims: int, base: float, mrope_section: list[int]):
        super().__init__()
        self.dims = dims
        j = np.arange(dims // 2)
        stream = np.zeros(dims // 2, dtype=np.int32)
        stream[(j % 3 == 1) & (j < 3 * mrope_section[1])] = 1
        stream[(j % 3 == 2) & (j < 3 * mrope_section[2])] = 2
        self._stream = mx.array(stream)
        self._inv_freq = mx.array(1.0 / base ** (np.arange(0, dims, 2) / dims), dtype=mx.float32)
        self.positions: mx.array | None = None

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.positions is None:
            raise ValueError("Qwen3.5's M-RoPE needs the step's positions")
        # [3, T, 1] -> [T, dims/2]: each frequency at its stream's position.
        pos = self.positions[:, :, 0].astype(mx.float32)  # [3, T]
        angles = pos[self._stream].T * self._inv_freq  # [T, dims/2]
        cos = mx.cos(angles)[:, None, None, :]
        sin = mx.sin(angles)[:, None, None, :]
        rot, rest = x[..., : self.dims].astype(mx.float32), x[..., self.dims :]
        half = self.dims // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return mx.concatenate([out.astype(x.dtype), rest], axis=-1)


class Adapter(qwen3_5.Adapter, MultimodalAdapter):
    """The state-hybrid adapter of the language model (mlx-lm's class, `self.model`) with the
    vision tower beside it (`self.vision_tower`, attached by `load_towers`)."""

    modalities = MODALITIES
    uses_mrope = True

    def __init__(self, model: Any, config: dict[str, Any], vision_config: dict[str, Any]):
        qwen3_5.Adapter.__init__(self, model, config)
        self.vision_config = vision_config  # the wrapper's `vision_config`
        self.media_token_ids: dict[str, int] = {}
        self.vision_tower: nn.Module | None = None
        self._ropes: list[InterleavedMRoPE] = []

    # The language model is mlx-lm's (`ModelAdapter`'s layout), not mlx-vlm's.
    language_model = property(lambda self: self.model)
    decoder = property(lambda self: self.model.model)
    num_layers = property(lambda self: len(self.model.layers))
    logits = qwen3_5.Adapter.logits

    def install_paged_attention(self) -> None:
        super().install_paged_attention()
        rope = self.config["rope_parameters"]
        head_dim = self.config["head_dim"]
        dims = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        for layer in self.model.layers:
            if not layer.is_linear:
                layer.self_attn.rope = InterleavedMRoPE(
                    dims, float(rope["rope_theta"]), list(rope["mrope_section"])
                )
                self._ropes.append(layer.self_attn.rope)

    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
    ) -> mx.array:
        if positions is None:
            raise ValueError(f"{self.model_type} places its tokens with M-RoPE positions")
        for rope in self._ropes:
            rope.positions = positions
        return self.decode_layers(input_embeds, caches)

    def load_towers(self, path: Path, config: dict[str, Any], compute_dtype: mx.Dtype) -> None:
        """Build mlx-vlm's tower from the checkpoint's tower tensors in `path`."""
        from mlx_vlm.models.qwen3_5.config import VisionConfig
        from mlx_vlm.models.qwen3_5.vision import VisionModel

        tower = VisionModel(VisionConfig.from_dict(config["vision_config"]))
        weights = {}
        for file in sorted(path.glob("*.safetensors")):
            for name, value in mx.load(str(file)).items():
                prefix = next((p for p in _TOWER_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    weights[name[len(prefix) :]] = value
        if not weights:
            raise ValueError(
                f"{path}: no vision tower tensors ({', '.join(_TOWER_PREFIXES)}*; a checkpoint "
                "converted by mlx-lm drops them): serve it with --language-model-only"
            )
        tower.load_weights(list(tower.sanitize(weights).items()))
        tower.set_dtype(compute_dtype)
        mx.eval(tower.parameters())
        self.vision_tower = tower.eval()
        self.media_token_ids = {
            "image": config["image_token_id"],
            "video": config["video_token_id"],
        }

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        tower = self.vision_tower
        if tower is None:
            raise ValueError(f"{self.model_type} encodes {sorted(MODALITIES)}, not {modality}")
        merge = self.vision_config["spatial_merge_size"]
        return encode_items(
            lambda pixels, grids: tower(pixels, grids)[0],
            tower, merge, self.model_type, modality, items,
        )  # fmt: skip

    def mrope_positions(
        self, prompt_token_ids: list[int], items: list[tuple[str, dict[str, np.ndarray]]]
    ) -> tuple[np.ndarray, int]:
        runs: dict[int, list[Grid]] = {token: [] for token in self.media_token_ids.values()}
        for modality, tensors in items:
            runs[self.media_token_ids[modality]].extend(timestamped_runs(modality, tensors))
        return place_tokens(prompt_token_ids, runs, self.vision_config["spatial_merge_size"])
