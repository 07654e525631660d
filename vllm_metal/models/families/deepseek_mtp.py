"""The multi-token-prediction layers of DeepSeek-V3, Kimi K2 and GLM-4.7-Flash (vLLM's
`DeepSeekMTP` / `Glm4MoeLiteMTP`), the drafter of `--speculative-config '{"method": "mtp"}'`.

The checkpoints keep each MTP layer as one more decoder layer, `model.layers.{N + i}.*` after the
target's N (`num_nextn_predict_layers` of them). At position p the layer reads the embedding of
the token at p + 1 (zeroed at position 0, as vLLM does) and the target's final hidden state at p,
RMS-norms each (`enorm`, `hnorm`), joins them with `eh_proj`, runs a whole decoder layer of the
target's make (multi-head latent attention over its own latent cache, the MoE block) and
`shared_head.norm`; the target's embeddings and LM head are shared (as vLLM shares them), so the
result's logits predict the token at p + 2. A chained draft step is fed the normed output
(DeepSeek-V3, Kimi K2) or the output before the norm (GLM-4.7-Flash), as vLLM feeds them. Draft
step j runs layer j mod their number. mlx-lm drops these tensors when it loads the target; this
module reads them from the checkpoint and builds the decoder layer from mlx-lm's own class, its
tensors put in mlx-lm's layout by mlx-lm's own `sanitize` (experts stacked, `kv_b_proj` split).
Mirrors mlx-lm 0.32.2 (`models/deepseek_v3.py`, `models/glm4_moe_lite.py`) and vLLM 0.32's
`deepseek_mtp.py` / `glm4_moe_lite_mtp.py`.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
from mlx import nn

from vllm_metal.models.families.deepseek_v3 import latent_kind
from vllm_metal.models.families.mtp_weights import read_renamed
from vllm_metal.models.layers import LayerKind

# The targets whose checkpoints carry these layers (`families.mtp_model_types`), and the mlx-lm
# module and decoder layer class each MTP layer is made of.
DECODER_LAYERS = {
    "deepseek_v3": ("deepseek_v3", "DeepseekV3DecoderLayer"),
    "kimi_k2": ("deepseek_v3", "DeepseekV3DecoderLayer"),
    "glm4_moe_lite": ("glm4_moe_lite", "Glm4MoeLiteDecoderLayer"),
}
MODEL_TYPES = tuple(DECODER_LAYERS)
# The drafter's model type as vLLM names it once it reads the target's config as the draft's.
DRAFT_MODEL_TYPES = ("deepseek_mtp", "glm4_moe_lite_mtp")
HEAD_IN_TARGET = True
NUM_LAYERS_KEY = "num_nextn_predict_layers"
# Targets whose chained draft steps are fed the output before `shared_head.norm` (vLLM's
# `Glm4MoeLiteMTP` returns one hidden state; `DeepSeekMTP` returns both and recycles the normed).
RECYCLES_PRE_NORM = ("glm4_moe_lite",)
# The tensors of an MTP layer that are not its decoder layer's; the copies of the embeddings and
# LM head the checkpoints carry (`embed_tokens`, `shared_head.head`) are not read.
OWN = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
UNREAD = ("embed_tokens", "shared_head.head")


class SharedHead(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(size, eps=eps)


class MTPLayer(nn.Module):
    def __init__(self, args: Any, layer_class: type, index: int):
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(size, eps=eps)
        self.hnorm = nn.RMSNorm(size, eps=eps)
        self.eh_proj = nn.Linear(2 * size, size, bias=False)
        self.block = layer_class(args, index)
        self.shared_head = SharedHead(size, eps)


class MTPHead(nn.Module):
    def __init__(self, args: Any, layer_class: type, num_layers: int, recycles_pre_norm: bool):
        super().__init__()
        first = args.num_hidden_layers
        self.layers = [MTPLayer(args, layer_class, first + i) for i in range(num_layers)]
        self.recycles_pre_norm = recycles_pre_norm

    def layer_kinds(self) -> list[LayerKind]:
        """The KV memory of each layer: one latent row per token (`kv.latent`)."""
        return [latent_kind(layer.block.self_attn) for layer in self.layers]

    def __call__(
        self, embeds: mx.array, hidden: mx.array, cache: Any, step: int
    ) -> tuple[mx.array, mx.array]:
        """From the next tokens' embeddings and the previous hidden states at the same packed rows
        (`[T, 1, hidden]`), the normed output the LM head reads and the hidden state a chained
        step is fed, writing the rows' latent K/V through `cache` (the latent view of layer
        `step mod layers`)."""
        layer = self.layers[step % len(self.layers)]
        at_start = (cache.offset == 0).reshape(-1, 1, 1)
        embeds = mx.where(at_start, mx.zeros_like(embeds), embeds)
        joined = mx.concatenate([layer.enorm(embeds), layer.hnorm(hidden)], axis=-1)
        out = layer.block(layer.eh_proj(joined), None, cache)
        normed = layer.shared_head.norm(out)
        return normed, out if self.recycles_pre_norm else normed


def num_layers(config: dict[str, Any]) -> int:
    return int(config.get(NUM_LAYERS_KEY) or 0)


def missing(target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    """What keeps the target's config from drafting with its MTP layers (the weights are checked
    when they load)."""
    if num_layers(target) < 1:
        return f"the checkpoint declares no MTP layers ({NUM_LAYERS_KEY})"
    return None


def load_head(config: dict[str, Any], model_dir: Path, compute_dtype: mx.Dtype) -> MTPHead:
    """The MTP layers of the checkpoint in `model_dir` (`config`: its config as mlx-lm reads it).
    Raises ValueError naming what is missing when the checkpoint has none."""
    model_type = config.get("model_type")
    count = num_layers(config)
    if count < 1:
        raise ValueError(
            f"{model_type}: the checkpoint declares no MTP layers "
            f"({NUM_LAYERS_KEY} is {config.get(NUM_LAYERS_KEY)!r})"
        )
    module_name, layer_class = DECODER_LAYERS[model_type]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = module.ModelArgs.from_dict(config)
    first = args.num_hidden_layers
    weights = _read_layers(model_dir, first, count)
    absent = [first + i for i in range(count) if not any(k.startswith(f"{i}.") for k in weights)]
    if absent:
        raise ValueError(
            f"{model_dir}: the checkpoint has no model.layers.{absent[0]}.* tensors for its MTP "
            f"layer ({NUM_LAYERS_KEY} is {count}; MLX conversions drop them: serve the original "
            "checkpoint for method 'mtp')"
        )
    quantized = sorted(k for k in weights if k.endswith((".scales", "_scale_inv")))
    if quantized:
        raise ValueError(
            f"{model_dir}: the MTP layers are quantized ({quantized[0]}); vllm-metal reads "
            "float MTP layers"
        )
    head = MTPHead(
        args,
        getattr(module, layer_class),
        count,
        recycles_pre_norm=model_type in RECYCLES_PRE_NORM,
    )
    head.load_weights(list(_sanitize(module, args, weights, count).items()), strict=True)
    head.set_dtype(compute_dtype)
    mx.eval(head.parameters())
    return head


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The target's tensors without its MTP layers, run before mlx-lm's DeepSeek-V3 `sanitize`
    (`families.SANITIZERS`), which drops only `model.layers.61` (where the published
    checkpoints keep it): a layer is an MTP layer when it has an `eh_proj`."""
    mtp = {
        name.split(".")[2] for name in weights if re.match(r"model\.layers\.\d+\.eh_proj\.", name)
    }
    return {
        name: value
        for name, value in weights.items()
        if not (name.startswith("model.layers.") and name.split(".")[2] in mtp)
    }


def _sanitize(module: Any, args: Any, weights: dict[str, mx.array], count: int) -> dict:
    """The MTP layers' tensors named as `MTPHead`'s parameters; each decoder layer's through
    mlx-lm's own `sanitize` (experts stacked, `kv_b_proj` split into `embed_q` / `unembed_out`),
    run as if the MTP layers were a model of `count` layers."""
    own, block = {}, {}
    for name, value in weights.items():
        index, rest = name.split(".", 1)
        if rest.startswith(OWN):
            own[f"layers.{index}.{rest}"] = value
        elif not rest.startswith(UNREAD):
            block[f"model.layers.{index}.{rest}"] = value
    shaped = SimpleNamespace(args=SimpleNamespace(**{**vars(args), "num_hidden_layers": count}))
    block = module.Model.sanitize(shaped, block)
    for name, value in block.items():
        index, rest = name[len("model.layers.") :].split(".", 1)
        own[f"layers.{index}.block.{rest}"] = value
    return own


def _read_layers(model_dir: Path, first: int, count: int) -> dict[str, mx.array]:
    """The tensors of checkpoint layers first .. first + count - 1, named `{i}.<rest>` (i counted
    from 0)."""
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def rename(name: str) -> str | None:
        match = pattern.match(name)
        if match is None or not first <= int(match[1]) < first + count:
            return None
        return f"{int(match[1]) - first}.{match[2]}"

    return read_renamed(model_dir, rename)
