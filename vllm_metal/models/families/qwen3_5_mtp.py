"""Qwen3.5 / 3.6's multi-token-prediction head (`mtp.*` in the published checkpoints; vLLM's
`Qwen3_5MTP` / `Qwen3_5MoeMTP`), the drafter of `--speculative-config '{"method": "mtp"}'`.

At position p the head reads the target's final hidden state there and the embedding of the
token at p + 1, each RMS-normed, joins them with `fc`, runs one gated full-attention decoder layer
of the target's own make (dense MLP or MoE block) with its own paged K/V, and a final norm; the
target's embeddings and LM head are shared, so the result's logits predict the token at p + 2.
A checkpoint may carry several such layers; draft step j runs layer j mod their number, as vLLM
does. mlx-lm drops these weights when it loads the target; this module reads them from the
checkpoint's safetensors and builds the layer from mlx-lm's `qwen3_5` decoder layer.
Mirrors mlx-lm 0.32.2 (`models/qwen3_5.py`) and vLLM 0.32's `qwen3_5_mtp.py` (weights only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from vllm_metal.models.families import qwen3_5
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind

# The targets whose checkpoints carry this head (`families.mtp_model_types`).
MODEL_TYPES = qwen3_5.MODEL_TYPES
# The drafter's model type as vLLM names it once it reads the target's config as the draft's.
DRAFT_MODEL_TYPES = ("qwen3_5_mtp",)
HEAD_IN_TARGET = True
PREFIX = "mtp."
# The config field giving the number of MTP layers (vLLM's `n_predict` for Qwen3.5).
NUM_LAYERS_KEY = "mtp_num_hidden_layers"


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs, num_layers: int):
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        # mlx-lm makes a layer full attention by its index in the layer pattern.
        full_attention_index = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, full_attention_index) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(size, eps=eps)

    def layer_kinds(self) -> list[LayerKind]:
        """The KV memory of each layer: full attention, in the target's shape."""
        return [FULL_ATTENTION] * len(self.layers)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any, step: int) -> mx.array:
        """Normed hidden states (`[T, 1, hidden]`) from the next tokens' embeddings and the
        previous hidden states at the same packed rows, writing the rows' K/V through `cache`
        (the paged view of layer `step mod layers`)."""
        joined = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        layer = self.layers[step % len(self.layers)]
        return self.norm(layer(self.fc(joined), None, cache))


def num_layers(config: dict[str, Any]) -> int:
    return int(config.get(NUM_LAYERS_KEY) or 0)


def missing(target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    """What keeps the target's text config from drafting with its head (the weights are
    checked when it loads)."""
    if num_layers(target) < 1:
        return f"the checkpoint declares no MTP layers ({NUM_LAYERS_KEY})"
    return None


def load_head(config: dict[str, Any], model_dir: Path, compute_dtype: mx.Dtype) -> MTPHead:
    """The head of the checkpoint in `model_dir` (`config`: its text config). Raises ValueError
    naming what is missing when the checkpoint has no head."""
    count = num_layers(config)
    if count < 1:
        raise ValueError(
            f"{config.get('model_type')}: the checkpoint declares no MTP layers "
            f"({NUM_LAYERS_KEY} is {config.get(NUM_LAYERS_KEY)!r})"
        )
    weights, hf_layout = _read_prefixed(model_dir, PREFIX)
    if not weights:
        raise ValueError(
            f"{model_dir}: the checkpoint has no {PREFIX}* weights (MLX conversions drop the "
            "MTP head; serve the original checkpoint for method 'mtp')"
        )
    head = MTPHead(TextModelArgs.from_dict(config), count)
    head.load_weights(list(_sanitize(weights, hf_layout).items()), strict=True)
    head.set_dtype(compute_dtype)
    mx.eval(head.parameters())
    return head


def _sanitize(weights: dict[str, mx.array], hf_layout: bool) -> dict[str, mx.array]:
    """mlx-lm's layout: experts stacked (`qwen3_5.sanitize`, or the fused `gate_up_proj`),
    and in a Hugging Face checkpoint the norms' stored offsets from 1 made scales."""
    weights = qwen3_5.sanitize(weights)
    out = {}
    for name, value in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            mlp = name[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{mlp}.switch_mlp.gate_proj.weight"] = gate
            out[f"{mlp}.switch_mlp.up_proj.weight"] = up
        elif name.endswith(".experts.down_proj"):
            out[name.replace(".experts.down_proj", ".switch_mlp.down_proj.weight")] = value
        elif hf_layout and "norm" in name and value.ndim == 1:
            out[name] = value + 1.0
        else:
            out[name] = value
    return out


def _read_prefixed(model_dir: Path, prefix: str) -> tuple[dict[str, mx.array], bool]:
    """The tensors named `prefix`* (prefix dropped) from the checkpoint's safetensors, and
    whether the checkpoint is in Hugging Face's layout: its Gated DeltaNet conv kernels not yet
    in mlx-lm's, the sign mlx-lm's `sanitize` reads too."""
    from safetensors import safe_open

    from vllm_metal.models.loaders.safetensors import tensor_files

    files = tensor_files(model_dir)
    weights: dict[str, mx.array] = {}
    for path in sorted({files[n] for n in files if n.startswith(prefix)}):
        tensors = mx.load(str(path))
        weights |= {n[len(prefix) :]: v for n, v in tensors.items() if n.startswith(prefix)}
    conv = next((n for n in files if n.endswith("conv1d.weight")), None)
    hf_layout = False
    if conv is not None:
        with safe_open(files[conv], framework="numpy") as f:
            hf_layout = f.get_slice(conv).get_shape()[-1] != 1
    return weights, hf_layout
