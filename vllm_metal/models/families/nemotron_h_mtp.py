"""Nemotron-H's multi-token-prediction layers (`mtp.*` in the checkpoints; vLLM's `NemotronHMTP`),
the drafter of `--speculative-config '{"method": "mtp"}'`.

The MTP step is a short stack of Nemotron-H blocks, one per character of the config's
`mtp_hybrid_override_pattern` (`mtp_layers_block_type` as transformers 5 writes it; "*E" as
published: attention, then a MoE block). At position p the first block's input is `eh_proj` of
the RMS-normed embedding of the token at p + 1 (`enorm`) joined with the RMS-normed final hidden
state of the target at p (`hnorm`); each block is a residual block around its mixer (attention
without RoPE over its own paged K/V, or the sigmoid-routed MoE), and the last block's output is
normed (`final_layernorm`). The target's embeddings and LM head are shared, so the result's logits
predict the token at p + 2, and a chained draft step is fed that normed output, as vLLM does.
vLLM builds one MTP step (`num_nextn_predict_layers` 1) with attention and MoE blocks only; so
does this module, and it keeps one attention block per step (the published pattern's).
mlx-lm drops these tensors when it loads the target; this module reads them from the checkpoint
and builds the blocks from mlx-lm's `NemotronHBlock`. Mirrors mlx-lm 0.32.2
(`models/nemotron_h.py`) and vLLM 0.32's `nemotron_h_mtp.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.nemotron_h import ModelArgs, NemotronHBlock

from vllm_metal.models.families.mtp_weights import read_renamed
from vllm_metal.models.layers import FULL_ATTENTION, LayerKind

# The targets whose checkpoints carry these layers (`families.mtp_model_types`).
MODEL_TYPES = ("nemotron_h",)
# The drafter's model type as vLLM names it once it reads the target's config as the draft's.
DRAFT_MODEL_TYPES = ("nemotron_h_mtp",)
HEAD_IN_TARGET = True
PREFIX = "mtp."
NUM_LAYERS_KEY = "num_nextn_predict_layers"
# How transformers 5 names the block kinds (`mtp_layers_block_type`) that the pattern's
# characters name; vLLM builds an MTP step of "*" and "E" blocks only.
BLOCK_CHARS = {
    "full_attention": "*",
    "attention": "*",
    "moe": "E",
    "linear_attention": "M",
    "mamba": "M",
    "mlp": "-",
}


class MTPBlock(NemotronHBlock):
    """A Nemotron-H block; the step's first also joins the embedding and hidden state, its last
    norms the output."""

    def __init__(self, args: ModelArgs, block_type: str, first: bool, last: bool):
        super().__init__(args, block_type)
        size, eps = args.hidden_size, args.layer_norm_epsilon
        if first:
            self.enorm = nn.RMSNorm(size, eps=eps)
            self.hnorm = nn.RMSNorm(size, eps=eps)
            self.eh_proj = nn.Linear(2 * size, size, bias=False)
        if last:
            self.final_layernorm = nn.RMSNorm(size, eps=eps)


class MTPHead(nn.Module):
    def __init__(self, args: ModelArgs, pattern: str):
        super().__init__()
        last = len(pattern) - 1
        self.layers = [MTPBlock(args, c, i == 0, i == last) for i, c in enumerate(pattern)]

    def layer_kinds(self) -> list[LayerKind]:
        """The KV memory of the step: its one attention block's, in the target's shape."""
        return [FULL_ATTENTION]

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any, step: int) -> mx.array:
        """The normed output (`[T, 1, hidden]`, what the LM head reads and a chained step is fed)
        from the next tokens' embeddings and the previous hidden states at the same packed rows,
        writing the rows' K/V through `cache` (the paged view of the attention block)."""
        first = self.layers[0]
        h = first.eh_proj(mx.concatenate([first.enorm(embeds), first.hnorm(hidden)], axis=-1))
        for block in self.layers:
            h = block(h, None, cache if block.block_type == "*" else None)
        return self.layers[-1].final_layernorm(h)


def pattern_of(config: dict[str, Any]) -> str:
    """The MTP step's block characters ("*E"), from either spelling of the config."""
    pattern = config.get("mtp_hybrid_override_pattern")
    if pattern is None:
        kinds = config.get("mtp_layers_block_type") or ()
        pattern = "".join(BLOCK_CHARS.get(kind, f"[{kind}]") for kind in kinds)
    return "".join(pattern)


def num_layers(config: dict[str, Any]) -> int:
    return int(config.get(NUM_LAYERS_KEY) or 0)


def missing(target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    """What keeps the target's config from drafting with its MTP layers (the weights are checked
    when they load)."""
    count = num_layers(target)
    if count < 1:
        return f"the checkpoint declares no MTP layers ({NUM_LAYERS_KEY})"
    if count != 1:
        return f"{NUM_LAYERS_KEY} is {count}; Nemotron-H drafts with one MTP step, as vLLM does"
    pattern = pattern_of(target)
    if not pattern or set(pattern) - {"*", "E"} or pattern.count("*") != 1:
        return (
            f"its MTP pattern {pattern!r} is not served: the MTP step's blocks are built from one "
            "attention block ('*') and MoE blocks ('E')"
        )
    return None


def load_head(config: dict[str, Any], model_dir: Path, compute_dtype: mx.Dtype) -> MTPHead:
    """The MTP step of the checkpoint in `model_dir` (`config`: its config as mlx-lm reads it).
    Raises ValueError naming what is missing when the checkpoint has none."""
    problem = missing(config, {})
    if problem is not None:
        raise ValueError(f"{config.get('model_type')}: {problem}")
    weights = read_renamed(model_dir, lambda n: n[len(PREFIX) :] if n.startswith(PREFIX) else None)
    if not weights:
        raise ValueError(
            f"{model_dir}: the checkpoint has no {PREFIX}* weights (MLX conversions drop the "
            "MTP layers; serve the original checkpoint for method 'mtp')"
        )
    pattern = pattern_of(config)
    head = MTPHead(ModelArgs.from_dict(config), pattern)
    head.load_weights(list(_sanitize(weights, len(pattern)).items()), strict=True)
    head.set_dtype(compute_dtype)
    mx.eval(head.parameters())
    return head


def _sanitize(weights: dict[str, mx.array], num_blocks: int) -> dict[str, mx.array]:
    """mlx-lm's layout: each MoE block's experts stacked (`switch_mlp.fc1` / `fc2`)."""
    weights = dict(weights)
    for i in range(num_blocks):
        prefix = f"layers.{i}.mixer"
        for name, stacked in (("up_proj", "fc1"), ("down_proj", "fc2")):
            experts = sorted(
                (int(k.split(".")[4]), k)
                for k in weights
                if k.startswith(f"{prefix}.experts.") and k.endswith(f".{name}.weight")
            )
            if experts:
                to_join = [weights.pop(k) for _, k in experts]
                weights[f"{prefix}.switch_mlp.{stacked}.weight"] = mx.stack(to_join)
    return weights
