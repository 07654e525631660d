"""Gemma 4 with its vision tower (the published `Gemma4ForConditionalGeneration`): the language
model of `families.gemma4` (through mlx-lm: per-layer head sizes, shared-KV layers, per-layer
inputs) with mlx-vlm's Gemma 4 vision tower and `embed_vision` projector beside it
(`families.gemma4_vision` encodes the items).

What the images change in the language model (transformers' `Gemma4Model`):
- an image's rows replace its `image_token_id` embeddings unscaled (text rows are scaled by
  sqrt(hidden), `gemma4.Adapter.embed`);
- the per-layer inputs of the models that have them take the pad token's per-layer embedding at
  an image's tokens (and their projected part from the merged rows);
- with `use_bidirectional_attention: "vision"` (vLLM's `is_mm_prefix_lm`) the tokens of one image
  attend to each other both ways in the sliding-window layers (`runner/mm/spans.py`'s key ends,
  still bounded below by the window); the full-attention layers stay causal.
Video and audio are not served here (a request with either gets vLLM's 400).

Served where vLLM's own Gemma 4 processor imports (`compat.vllm_models.uses_vllm_processor`):
elsewhere (Linux, without torchvision) `config.multimodal` sets `language_model_only` and the
language model alone is served by `families.gemma4`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from vllm_metal.models.adapter import ModelAdapter
from vllm_metal.models.families import gemma4
from vllm_metal.models.families.gemma4_vision import encode_items
from vllm_metal.models.multimodal import MultimodalAdapter, TokenRows

# What this family is to the capability table (`vllm_metal.config.kinds`).
MODEL_TYPES = ("gemma4",)
KIND = "vision_language"
MODALITIES: tuple[str, ...] = ("image",)

# Tensor-name prefixes of the towers in Hugging Face's layout and mlx-vlm's converted one, and
# the module each lands in.
_TOWER_MODULES = ("vision_tower", "embed_vision")
_PREFIXES = ("model.", "")


def towers_run() -> bool:
    """Whether vLLM prepares this family's images here (its processor imports)."""
    from vllm_metal.compat.vllm_models import uses_vllm_processor

    return uses_vllm_processor("gemma4_mm")


class _Towers(nn.Module):
    """mlx-vlm's vision tower and projector of Gemma 4, without its language model."""

    def __init__(self, config: dict[str, Any]):
        from mlx_vlm.models.gemma4.config import VisionConfig
        from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
        from mlx_vlm.models.gemma4.vision import VisionModel

        super().__init__()
        vision = VisionConfig.from_dict(config["vision_config"])
        self.vision_tower = VisionModel(vision)
        self.embed_vision = MultimodalEmbedder(
            embedding_dim=vision.hidden_size,
            text_hidden_size=config["text_config"]["hidden_size"],
            eps=vision.rms_norm_eps,
        )


class Adapter(gemma4.Adapter, MultimodalAdapter):
    modalities = MODALITIES

    def __init__(self, model: Any, config: dict[str, Any], vision_config: dict[str, Any]):
        gemma4.Adapter.__init__(self, model, config)
        self.vision_config = vision_config  # the wrapper's `vision_config`
        self.bidirectional_media = config.get("use_bidirectional_attention") == "vision"
        self.bidirectional_sliding_only = True
        self.pad_token_id = int(config.get("pad_token_id") or 0)
        self.towers: _Towers | None = None

    # The language model is mlx-lm's (`ModelAdapter`'s layout and head, softcapping included).
    language_model = property(lambda self: self.model)
    decoder = property(lambda self: self.model.model)
    num_layers = property(lambda self: len(self.model.layers))
    logits = ModelAdapter.logits

    def forward(
        self,
        input_embeds: mx.array,
        caches: list[Any],
        positions: mx.array | None = None,
        rows: TokenRows | None = None,
        token_ids: mx.array | None = None,
    ) -> mx.array:
        if rows is not None and token_ids is not None and self.decoder.hidden_size_per_layer_input:
            # Media tokens take the pad token's per-layer embedding.
            token_ids = _at_pad(token_ids, rows.dest, self.pad_token_id)
        return gemma4.Adapter.forward(self, input_embeds, caches, token_ids)

    def load_towers(self, path: Path, config: dict[str, Any], compute_dtype: mx.Dtype) -> None:
        """Build mlx-vlm's tower and projector from the checkpoint's tensors in `path`."""
        towers = _Towers(config)
        clipped = bool(config["vision_config"].get("use_clipped_linears", False))
        weights = {}
        for file in sorted(path.glob("*.safetensors")):
            for name, value in mx.load(str(file)).items():
                local = _tower_name(name)
                if local is None or "rotary_emb" in local:
                    continue
                if not clipped and local.endswith(("input_max", "input_min", "output_max",
                                                   "output_min")):  # fmt: skip
                    continue
                weights[local] = value
        if not weights:
            raise ValueError(
                f"{path}: no vision tower tensors (vision_tower.*, embed_vision.*; a checkpoint "
                "converted by mlx-lm drops them): serve it with --language-model-only"
            )
        towers.load_weights(list(weights.items()))
        towers.set_dtype(compute_dtype)
        mx.eval(towers.parameters())
        self.towers = towers.eval()

    def embed_multimodal(self, modality: str, items: list[dict[str, np.ndarray]]) -> list[mx.array]:
        if self.towers is None or modality not in MODALITIES:
            raise ValueError(f"{self.model_type} encodes {sorted(MODALITIES)}, not {modality}")
        return encode_items(self.towers, modality, items)


def _tower_name(name: str) -> str | None:
    """`name` within `_Towers`, or None for a tensor of another part of the checkpoint."""
    for prefix in _PREFIXES:
        for module in _TOWER_MODULES:
            if name.startswith(f"{prefix}{module}."):
                return name[len(prefix) :]
    return None


def _at_pad(token_ids: mx.array, dest: np.ndarray, pad: int) -> mx.array:
    """`token_ids` ([T, 1]) with the rows `dest` set to `pad`."""
    mask = np.zeros(token_ids.shape[0], dtype=bool)
    mask[dest] = True
    return mx.where(mx.array(mask)[:, None], pad, token_ids)
