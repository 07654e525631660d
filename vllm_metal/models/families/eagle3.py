"""EAGLE-3 draft heads (`--speculative-config '{"method": "eagle3", "model": ...}'`): vLLM 0.32's
`Eagle3LlamaForCausalLM` (`llama_eagle3.py`; checkpoints named `LlamaForCausalLMEagle3` or
`Eagle3LlamaForCausalLM`) and `Eagle3Qwen3ForCausalLM` (`qwen3_eagle3.py`: the same with q/k norms).

The head reads the target's hidden states at several layers (the aux states: the input of the
layers `aux_layer_ids` name, id 0 the embeddings, id L the last layer's output before the final
norm), joined and projected by `fc` to the head's width. At position p its first layer joins the
RMS-normed embedding of the token at p + 1 with the RMS-normed hidden state at p (`fc`'s output,
or at later draft steps the head's own pre-norm output at p - 1) and attends with 2x-wide q/k/v
projections; the residual stream starts from the un-normed hidden state. Later layers are plain
decoder layers. A final norm and a draft-vocabulary LM head give logits whose argmax maps to a
target token through `d2t` (`target = draft + d2t[draft]`). A head without its own embeddings or
LM head shares the target's. Weights: `midlayer.*` (one layer) or `layers.N.*`, `fc`, `norm`,
`lm_head`, `d2t` (`t2d` is unused), optionally `embed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama, qwen3

from vllm_metal.compat.mlx_lm_attention import route_module_sdpa
from vllm_metal.models.layers import FULL_ATTENTION, kinds_from_config
from vllm_metal.ops.argmax import row_argmax

# vLLM's EAGLE-3 architecture names (after its `EAGLEConfig` rewrite) -> whether the head's
# attention norms q and k per head (the Qwen3 form).
ARCHITECTURES = {
    "Eagle3LlamaForCausalLM": False,
    "LlamaForCausalLMEagle3": False,
    "Eagle3Qwen3ForCausalLM": True,
}
# Targets whose decoder is embeddings -> layers -> final norm, so the runner keeps their aux
# states (`ModelAdapter.forward_with_aux`).
TARGET_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's aux layers of an L-layer target when the head's config names none
    (`SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class HeadConfig:
    args: dict[str, Any]  # the draft's config.json, as vLLM read it
    qk_norm: bool
    aux_layer_ids: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return int(self.args["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.args["hidden_size"])

    @property
    def target_hidden_size(self) -> int:
        return int(self.args.get("target_hidden_size") or self.hidden_size)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.args.get("draft_vocab_size") or self.args["vocab_size"])

    def option(self, name: str) -> bool:
        eagle = self.args.get("eagle_config") or {}
        return bool(eagle.get(name, self.args.get(name, False)))


def aux_layer_ids(draft: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The target layers feeding the head, as vLLM's runner picks them: the draft config's
    `eagle_aux_hidden_state_layer_ids` (top level, then `eagle_config`), else its default."""
    ids = draft.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else default_aux_layers(num_target_layers)


def target_problem(target: dict[str, Any]) -> str | None:
    """What keeps a head fed the aux hidden states of `target` (its text config dict) from
    drafting for it, or None: the runner keeps them for `TARGET_TYPES`, and the head's layers
    share the target's full-attention KV-cache group."""
    if target.get("model_type") not in TARGET_TYPES:
        return (
            f"the target's aux hidden states are kept for {', '.join(TARGET_TYPES)} targets, "
            f"not {target.get('model_type')!r}"
        )
    if FULL_ATTENTION not in kinds_from_config(target, int(target["num_hidden_layers"])):
        return (
            "the target has no full-attention layer (every layer attends over a sliding window), "
            "and the head's layers share the target's full-attention KV-cache group"
        )
    return None


def missing(architecture: str, draft: dict[str, Any], target: dict[str, Any]) -> str | None:
    """What keeps the head `draft` (config dict, vLLM's architecture name) from drafting for
    `target` (its text config dict) here, or None."""
    if architecture not in ARCHITECTURES:
        return f"the EAGLE-3 head {architecture} is not built (built: {', '.join(ARCHITECTURES)})"
    problem = target_problem(target)
    if problem is not None:
        return problem
    if (draft.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        return "heads without aux hidden states (use_aux_hidden_state false) are not built"
    layers = int(target["num_hidden_layers"])
    ids = aux_layer_ids(draft, layers)
    if any(not 0 <= i <= layers for i in ids):
        return f"aux layer ids {list(ids)} are outside the target's 0..{layers}"
    if len(set(ids)) != len(ids):
        return f"aux layer ids {list(ids)} repeat a layer"
    if int(draft.get("target_hidden_size") or draft["hidden_size"]) != target["hidden_size"]:
        return "its target_hidden_size differs from the target's hidden_size"
    return None


def _args(module: Any, config: dict[str, Any]) -> Any:
    fields = {**config, "model_type": config.get("model_type", "llama")}
    fields.setdefault("tie_word_embeddings", False)
    if not fields.get("rope_theta"):
        fields["rope_theta"] = (fields.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return module.ModelArgs.from_dict(fields)


class Layer(nn.Module):
    """One decoder layer of the head: the first one takes [embeds; hidden] (2x-wide q/k/v)."""

    def __init__(self, cfg: HeadConfig, first: bool):
        super().__init__()
        family = qwen3 if cfg.qk_norm else llama
        args = _args(family, cfg.args)
        size, eps = cfg.hidden_size, float(cfg.args["rms_norm_eps"])
        self.self_attn = family.Attention(args)
        attn = self.self_attn
        bias = bool(cfg.args.get("attention_bias", False))
        width = 2 * size if first else size
        heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
        head_dim = args.head_dim or size // heads
        attn.q_proj = nn.Linear(width, heads * head_dim, bias=bias)
        attn.k_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        attn.v_proj = nn.Linear(width, kv_heads * head_dim, bias=bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(size, eps=eps)
        if first:
            self.hidden_norm = nn.RMSNorm(size, eps=eps)
        self.first = first
        self.norm_before_residual = cfg.option("norm_before_residual")

    def __call__(
        self, embeds: mx.array, hidden: mx.array, residual: mx.array | None, cache: Any
    ) -> tuple[mx.array, mx.array]:
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual = hidden + residual
            x = self.input_layernorm(residual)
        residual = self.self_attn(x, None, cache) + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class Eagle3Head(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        size, eps = cfg.hidden_size, float(cfg.args["rms_norm_eps"])
        fc_in = cfg.target_hidden_size * len(cfg.aux_layer_ids)
        self.fc = nn.Linear(fc_in, size, bias=False)
        if cfg.option("norm_before_fc"):
            self.input_norm = nn.RMSNorm(fc_in, eps=eps)
        if cfg.args.get("fc_norm"):
            self.fc_norm = [nn.RMSNorm(cfg.target_hidden_size, eps=eps) for _ in cfg.aux_layer_ids]
        self.layers = [Layer(cfg, i == 0) for i in range(cfg.num_layers)]
        self.norm = nn.RMSNorm(size, eps=eps)
        self.norm_output = bool(cfg.args.get("norm_output", False))
        # Set by `load_head` where the checkpoint carries them; else the target's are used.
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None
        self.d2t: mx.array | None = None  # [draft_vocab] int32 offsets, None: same vocabulary

    def combine(self, aux: mx.array) -> mx.array:
        """vLLM's `combine_hidden_states`: the target's aux states `[T, 1, n * target_hidden]`
        to the head's width."""
        if "input_norm" in self:
            aux = self.input_norm(aux)
        if "fc_norm" in self:
            chunks = mx.split(aux, len(self.fc_norm), axis=-1)
            aux = mx.concatenate([n(c) for n, c in zip(self.fc_norm, chunks)], axis=-1)
        return self.fc(aux)

    def __call__(
        self, embeds: mx.array, hidden: mx.array, caches: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """(normed output, the hidden state the next draft step reads), `[T, 1, hidden]` each,
        from the next tokens' embeddings and the hidden states at the same packed rows,
        writing each layer's K/V through its paged view in `caches`."""
        residual = None
        for layer, cache in zip(self.layers, caches, strict=True):
            hidden, residual = layer(embeds, hidden, residual, cache)
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        return normed, normed if self.norm_output else prenorm

    def draft_tokens(self, logits: mx.array) -> mx.array:
        """Target token ids of the argmax of draft-vocabulary logits `[T, Vd]`."""
        best = row_argmax(logits)
        return best if self.d2t is None else best + self.d2t[best]


def load_head(
    architecture: str,
    draft: dict[str, Any],
    num_target_layers: int,
    target_vocab_size: int,
    model_dir: Path,
    compute_dtype: mx.Dtype,
) -> Eagle3Head:
    """The head of the checkpoint in `model_dir` (`draft`: its config). Raises ValueError naming
    what is missing."""
    cfg = HeadConfig(draft, ARCHITECTURES[architecture], aux_layer_ids(draft, num_target_layers))
    head = Eagle3Head(cfg)
    weights = {n.replace("midlayer.", "layers.0."): v for n, v in _read(model_dir).items()}
    load_head_weights(head, weights, "EAGLE-3", model_dir, target_vocab_size, compute_dtype)
    mx.eval(head.parameters())
    for layer in head.layers:
        route_module_sdpa(layer.self_attn)
    return head


def load_head_weights(
    head: nn.Module,
    weights: dict[str, mx.array],
    label: str,
    model_dir: Path,
    target_vocab_size: int,
    compute_dtype: mx.Dtype,
) -> None:
    """A drafting head's tensors (`weights`, named as the head's parameters) into `head` (an
    EAGLE-3 or DFlash head, `head.cfg`): its own embeddings and LM head where the checkpoint has
    them, and the `d2t` map of a draft vocabulary. Raises ValueError naming what is missing."""
    cfg = head.cfg
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    if "embed_tokens.weight" in weights:
        head.embed_tokens = nn.Embedding(*weights["embed_tokens.weight"].shape)
    if "lm_head.weight" in weights:
        head.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
    elif cfg.draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"{model_dir}: the head's draft vocabulary ({cfg.draft_vocab_size}) differs from the "
            "target's and the checkpoint has no lm_head.weight"
        )
    if cfg.draft_vocab_size != target_vocab_size and d2t is None:
        raise ValueError(f"{model_dir}: a draft vocabulary needs its d2t map; it has none")
    wanted = {n for n, _ in _flat(head)}
    if missing_names := sorted(wanted - set(weights)):
        raise ValueError(f"{model_dir}: the {label} head lacks {', '.join(missing_names[:8])}")
    head.load_weights(list(weights.items()), strict=True)
    head.set_dtype(compute_dtype)
    if cfg.draft_vocab_size != target_vocab_size:
        head.d2t = d2t.astype(mx.int32)


def _flat(module: nn.Module) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _read(model_dir: Path) -> dict[str, mx.array]:
    """The head's tensors: its safetensors files, else its `pytorch_model.bin` (some published
    EAGLE-3 heads ship only that)."""
    from vllm_metal.models.loaders.safetensors import tensor_files

    weights: dict[str, mx.array] = {}
    for path in sorted(set(tensor_files(model_dir).values())):
        weights |= mx.load(str(path))
    if not weights and (model_dir / "pytorch_model.bin").is_file():
        import torch

        state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
        for name, value in state.items():
            value = value.float() if value.is_floating_point() else value
            weights[name] = mx.array(value.numpy())
    if not weights:
        raise ValueError(f"{model_dir}: no safetensors or pytorch_model.bin weights")
    return weights
