"""Shared steps of the Qwen-VL runner tests (`test_qwen_vl.py`, `test_qwen_vl_video.py`): vLLM's
view of a prompt with media items, and one request driven through the runner's multimodal path
as vLLM's scheduler drives it (`media_steps.run_greedy`).

vLLM 0.32 cannot build the Qwen-VL processors on Linux (they import torchvision, which does not
load beside torch 2.13.0+cpu), so each item is built with vLLM's own
`MultiModalKwargsItems.from_hf_inputs` and the field layout of vLLM's Qwen2-VL processor
(`_qwen2vl_field_config`: `pixel_values` flat by `image_grid_thw.prod()`, `pixel_values_videos`
flat by `video_grid_thw.prod()`, grids kept on the host; Qwen2.5-VL adds `second_per_grid_ts`),
from the oracle's processor outputs (`vision_oracles.qwen2_5_vl_inputs`, `vision_oracles.qwen3_vl_inputs`).
An item's placeholder is where vLLM's prompt update puts it: the run of its `<|image_pad|>` or
`<|video_pad|>` tokens, except for a Qwen3-VL (or Qwen3.5) video, whose placeholder spans all its
timestamped runs with `is_embed` set on the `<|video_pad|>` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from tests.backends.mlx.runner.media_steps import request_state, run_greedy

if TYPE_CHECKING:
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

NEW_TOKENS = 8
FIXTURES = {"qwen2_5_vl": "tiny_qwen2_5_vl_dir", "qwen3_vl": "tiny_qwen3_vl_dir"}


def load_family(request: Any, name: str) -> SimpleNamespace:
    """(name, checkpoint directory, its config.json, float32 adapter) of a Qwen-VL family."""
    from vllm_metal.models import load_model

    model_dir: Path = request.getfixturevalue(FIXTURES[name])
    config = json.loads((model_dir / "config.json").read_text())
    adapter = load_model(str(model_dir), compute_dtype=mx.float32, hf_config=config)
    return SimpleNamespace(name=name, dir=model_dir, config=config, adapter=adapter)


def _field_config(family: str, inputs: dict[str, Any]) -> dict[str, Any]:
    from vllm.multimodal.inputs import MultiModalFieldConfig as Field

    config = {}
    for modality, pixels in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        grid = inputs.get(f"{modality}_grid_thw")
        if grid is not None:
            config[pixels] = Field.flat_from_sizes(modality, grid.prod(-1))
            config[f"{modality}_grid_thw"] = Field.batched(modality, keep_on_cpu=True)
    if family == "qwen2_5_vl":
        config["second_per_grid_ts"] = Field.batched("video", keep_on_cpu=True)
    return config


def _runs(ids: np.ndarray, token: int) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of `token`."""
    edges = np.diff(np.concatenate([[0], (ids == token).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _placeholders(family, ids: np.ndarray, modality: str, grids) -> list[tuple[int, int, Any]]:
    """(offset, length, is_embed) of each item's placeholder, in prompt order."""
    import torch

    pad = family.config[f"{modality}_token_id"]
    runs = iter(_runs(ids, pad))
    out = []
    for grid in grids:
        t, h, w = (int(x) for x in grid)
        if family.name in ("qwen3_vl", "qwen3_5") and modality == "video":
            frames = [next(runs) for _ in range(t)]
            starts = np.flatnonzero(
                ids[: frames[0][0] - 1] == family.config["vision_start_token_id"]
            )
            offset, end = int(starts[-1]) + 1, frames[-1][1] + 1
            is_embed = torch.from_numpy(ids[offset:end] == pad)
        else:
            (offset, end), is_embed = next(runs), None
        assert (end - offset if is_embed is None else int(is_embed.sum())) == t * h * w // 4
        out.append((offset, end - offset, is_embed))
    assert next(runs, None) is None, "more placeholder runs than items"
    return out


def cached_request(
    family, inputs: dict[str, Any], names: dict[str, list[str]]
) -> CachedRequestState:
    """vLLM's view of a prompt: its token ids and one `MultiModalFeatureSpec` per media item,
    from the oracle's processor outputs; `names[modality]` are the items' cache identifiers."""
    from vllm.multimodal.inputs import (
        MultiModalFeatureSpec,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    ids = inputs["input_ids"][0].numpy()
    items = MultiModalKwargsItems.from_hf_inputs(inputs, _field_config(family.name, inputs))
    features: list[MultiModalFeatureSpec] = []
    for modality, modality_items in items.items():
        spans = _placeholders(family, ids, modality, inputs[f"{modality}_grid_thw"].tolist())
        for item, name, (offset, length, is_embed) in zip(
            modality_items, names[modality], spans, strict=True
        ):
            features.append(
                MultiModalFeatureSpec(
                    data=item,
                    modality=modality,
                    identifier=name,
                    mm_position=PlaceholderRange(offset=offset, length=length, is_embed=is_embed),
                    mm_hash=None,
                )
            )
    features.sort(key=lambda f: f.mm_position.offset)
    return request_state("r", ids.tolist(), features)


def greedy(adapter, state, chunk: int) -> tuple[list[int], np.ndarray]:
    """Prefill `chunk` tokens per step, then decode one token per step; greedy
    (`media_steps.run_greedy`). Also the logits of the prompt's last token."""
    return run_greedy(adapter, {"r": state}, chunk=chunk, new_tokens=NEW_TOKENS)["r"]
