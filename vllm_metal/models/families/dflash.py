"""DFlash draft heads (`--speculative-config '{"method": "dflash", "model": ...}'`): vLLM 0.32's
`DFlashQwen3ForCausalLM` (`qwen3_dflash.py`; checkpoints named `DFlashDraftModel`, or any Qwen3
architecture vLLM prefixes with `DFlash`).

The head drafts a whole block at once. The target's hidden states at a few layers (the aux
states: `dflash_config.target_layer_ids` t are the outputs of target layers t, aux ids t + 1 as
`eagle3.aux_layer_ids` counts them) are joined and projected by `fc`, RMS-normed by
`hidden_norm`, and each of the head's layers projects them with its own k/v projections (k normed
per head, RoPE at the position) into K/V at the target's positions: the context, written once per
position. The query is the token after the last context position followed by k mask tokens
(`mask_token_id`), at the next k + 1 positions; it runs through the head's Qwen3 decoder layers,
each attending over the context K/V and the query block's own K/V (both ways within the block,
unless every layer is causal), then the final norm and an LM head. The argmax at mask i is
draft i, mapped to a target token through `d2t` where the head has a draft vocabulary. A head
without its own embeddings or LM head shares the target's. Weights: `layers.N.*` (or
`midlayer.*`), `fc`, `hidden_norm`, `norm`, optionally `embed_tokens`, `lm_head`, `d2t`; an
optional `mask_embedding.pt` replaces the mask token's embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models.rope_utils import initialize_rope

from vllm_metal.models.families import eagle3
from vllm_metal.ops.argmax import row_argmax

# vLLM's DFlash architecture names (after its `EAGLEConfig` rewrite) served by this head.
ARCHITECTURES = ("DFlashDraftModel", "DFlashQwen3ForCausalLM")
# The target's aux states are kept for the same decoders as an EAGLE-3 head's.
TARGET_TYPES = eagle3.TARGET_TYPES
MASK_EMBEDDING_FILE = "mask_embedding.pt"


def _section(draft: dict[str, Any]) -> dict[str, Any]:
    """The head's drafter settings as vLLM's `DFlashQwen3Model` merges them: `eagle_config`,
    overridden by `dflash_config`."""
    return {**(draft.get("eagle_config") or {}), **(draft.get("dflash_config") or {})}


def mask_token_id(draft: dict[str, Any]) -> int | None:
    """The token the query's masked slots carry (vLLM's `parallel_drafting_token_id`)."""
    value = (draft.get("dflash_config") or {}).get("mask_token_id")
    return draft.get("mask_token_id") if value is None else value


def aux_layer_ids(draft: dict[str, Any]) -> tuple[int, ...]:
    """The target layers feeding the head as vLLM's runner picks them
    (`get_eagle3_aux_layers_from_config`): `eagle_aux_hidden_state_layer_ids`, else
    `dflash_config.target_layer_ids` + 1, else `dflash_config.layer_ids`; () where none."""
    ids = draft.get("eagle_aux_hidden_state_layer_ids")
    section = draft.get("dflash_config") or {}
    if not ids:
        ids = [i + 1 for i in (section.get("target_layer_ids") or [])]
    if not ids:
        ids = section.get("layer_ids") or (draft.get("eagle_config") or {}).get("layer_ids")
    return tuple(ids or ())


def layer_causal(draft: dict[str, Any], layer: int) -> bool:
    """vLLM's `_dflash_layer_causal`: `is_causal`, else `dflash_config.causal`, else whether
    `layer_types` names the layer sliding (non-causal when nothing says)."""
    if draft.get("is_causal") is not None:
        return bool(draft["is_causal"])
    override = (draft.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    types = draft.get("layer_types")
    return bool(types) and types[layer] == "sliding_attention"


def causal(draft: dict[str, Any]) -> bool:
    """Whether the query block attends causally: vLLM's V1 proposer runs every layer causal only
    when each is (`dflash_has_any_non_causal`), else every layer both ways within the block."""
    return all(layer_causal(draft, i) for i in range(int(draft["num_hidden_layers"])))


def missing(architecture: str, draft: dict[str, Any], target: dict[str, Any]) -> str | None:
    """What keeps the head `draft` (config dict, vLLM's architecture name) from drafting for
    `target` (its text config dict) here, or None."""
    if architecture not in ARCHITECTURES:
        return f"the DFlash head {architecture} is not built (built: {', '.join(ARCHITECTURES)})"
    problem = eagle3.target_problem(target)
    if problem is not None:
        return problem
    layers = int(target["num_hidden_layers"])
    section = _section(draft)
    if section.get("use_aux_hidden_state", draft.get("use_aux_hidden_state", True)) is False:
        return "heads without aux hidden states (use_aux_hidden_state false) are not built"
    if mask_token_id(draft) is None:
        return "its config names no mask token (dflash_config.mask_token_id or mask_token_id)"
    ids = aux_layer_ids(draft)
    if not ids:
        return "its config names no target layers (dflash_config.target_layer_ids)"
    if any(not 0 <= i <= layers for i in ids):
        return f"aux layer ids {list(ids)} are outside the target's 0..{layers}"
    if len(set(ids)) != len(ids):
        return f"aux layer ids {list(ids)} repeat a layer"
    if int(draft.get("target_hidden_size") or draft["hidden_size"]) != target["hidden_size"]:
        return "its target_hidden_size differs from the target's hidden_size"
    if section.get("use_swa") or "sliding_attention" in (draft.get("layer_types") or ()):
        return "sliding-window DFlash layers (use_swa, sliding layer_types) are not built"
    if section.get("attention_sink_bias") or draft.get("add_swa_attention_sink_bias"):
        return "DFlash layers with attention sink biases are not built"
    rope = draft.get("rope_parameters") or draft.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type") or "default") != "default":
        return f"its rope type {rope.get('rope_type') or rope.get('type')!r} is not built"
    return None


@dataclass(frozen=True)
class HeadConfig:
    args: dict[str, Any]  # the draft's config.json, as vLLM read it

    @property
    def hidden_size(self) -> int:
        return int(self.args["hidden_size"])

    @property
    def num_heads(self) -> int:
        return int(self.args["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.args["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        return int(self.args.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def eps(self) -> float:
        return float(self.args["rms_norm_eps"])

    @property
    def bias(self) -> bool:
        return bool(self.args.get("attention_bias", False))

    @property
    def draft_vocab_size(self) -> int:
        return int(self.args.get("draft_vocab_size") or self.args["vocab_size"])

    @property
    def rope_theta(self) -> float:
        rope = self.args.get("rope_parameters") or {}
        return float(self.args.get("rope_theta") or rope.get("rope_theta") or 1e6)

    @property
    def value_scale(self) -> float | None:
        return (self.args.get("dflash_config") or {}).get("attention_value_scale")


class Attention(nn.Module):
    """One layer's attention: q/k/v/o projections (biased with `attention_bias`), q and k
    RMS-normed per head, RoPE (neox unless `is_neox_style` is false)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        size, heads, kv_heads, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(size, heads * d, bias=cfg.bias)
        self.k_proj = nn.Linear(size, kv_heads * d, bias=cfg.bias)
        self.v_proj = nn.Linear(size, kv_heads * d, bias=cfg.bias)
        self.o_proj = nn.Linear(heads * d, size, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(d, eps=cfg.eps)
        self.k_norm = nn.RMSNorm(d, eps=cfg.eps)
        self.rope = initialize_rope(
            d,
            base=cfg.rope_theta,
            traditional=not cfg.args.get("is_neox_style", True),
            scaling_config=None,
        )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d
        self.scale = d**-0.5
        self.value_scale = cfg.value_scale

    def key_values(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """K (normed, rotated) and V of rows `x` `[T, 1, hidden]` at `positions`:
        `[T, kv_heads, 1, head_dim]` each."""
        t = x.shape[0]
        keys = self.k_norm(self.k_proj(x).reshape(t, self.kv_heads, 1, self.head_dim))
        values = self.v_proj(x).reshape(t, self.kv_heads, 1, self.head_dim)
        if self.value_scale is not None:
            values = values * self.value_scale
        return self.rope(keys, offset=positions), values

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        """The query rows `x` `[T, 1, hidden]` through a paged view `cache` (positions, the
        block's reach): their K/V written, then attention over the context and the block."""
        t = x.shape[0]
        queries = self.q_norm(self.q_proj(x).reshape(t, self.heads, 1, self.head_dim))
        queries = self.rope(queries, offset=cache.offset)
        keys, values = self.key_values(x, cache.offset)
        cache.update_and_fetch(keys, values)
        out = cache.attend(queries, self.scale, None)
        return self.o_proj(out.reshape(t, 1, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, size: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(size, inter, bias=False)
        self.up_proj = nn.Linear(size, inter, bias=False)
        self.down_proj = nn.Linear(inter, size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, int(cfg.args["intermediate_size"]))
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.eps)

    def __call__(self, h: mx.array, cache: Any) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    def __init__(self, cfg: HeadConfig, num_aux: int):
        super().__init__()
        self.cfg = cfg
        size = cfg.hidden_size
        target_size = int(cfg.args.get("target_hidden_size") or size)
        self.fc = nn.Linear(target_size * num_aux, size, bias=False)
        self.hidden_norm = nn.RMSNorm(size, eps=cfg.eps)
        self.layers = [Layer(cfg) for _ in range(int(cfg.args["num_hidden_layers"]))]
        self.norm = nn.RMSNorm(size, eps=cfg.eps)
        self.mask_token_id = int(mask_token_id(cfg.args))
        self.causal = causal(cfg.args)
        # Set by `load_head` where the checkpoint carries them; else the target's are used.
        self.embed_tokens: nn.Embedding | None = None
        self.lm_head: nn.Linear | None = None
        self.d2t: mx.array | None = None  # [draft_vocab] int32 offsets, None: same vocabulary
        self.mask_embedding: mx.array | None = None  # [hidden], from `mask_embedding.pt`

    def write_context(self, aux: mx.array, caches: list[Any]) -> None:
        """The context K/V of the target's aux states `aux` (`[T, 1, n * target_hidden]`, rows
        at the positions of `caches`' step), written through each layer's paged view."""
        states = self.hidden_norm(self.fc(aux))
        for layer, cache in zip(self.layers, caches, strict=True):
            keys, values = layer.self_attn.key_values(states, cache.offset)
            cache.update_and_fetch(keys, values)

    def embed(self, token_ids: mx.array, target_embed: Any) -> mx.array:
        """The query's embeddings `[T, 1, hidden]` (`token_ids` `[T, 1]`): the head's table or
        the target's, the mask token's replaced where the checkpoint ships its own."""
        table = self.embed_tokens if self.embed_tokens is not None else target_embed
        embeds = table(token_ids)
        if self.mask_embedding is not None:
            is_mask = (token_ids == self.mask_token_id)[..., None]
            embeds = mx.where(is_mask, self.mask_embedding.astype(embeds.dtype), embeds)
        return embeds

    def __call__(self, embeds: mx.array, caches: list[Any]) -> mx.array:
        """The normed output of the query rows `embeds` `[T, 1, hidden]`."""
        h = embeds
        for layer, cache in zip(self.layers, caches, strict=True):
            h = layer(h, cache)
        return self.norm(h)

    def draft_tokens(self, logits: mx.array) -> mx.array:
        """Target token ids of the argmax of draft-vocabulary logits `[T, Vd]`."""
        best = row_argmax(logits)
        return best if self.d2t is None else best + self.d2t[best]


def load_head(
    draft: dict[str, Any], target_vocab_size: int, model_dir: Path, compute_dtype: mx.Dtype
) -> DFlashHead:
    """The head of the checkpoint in `model_dir` (`draft`: its config). Raises ValueError naming
    what is missing."""
    cfg = HeadConfig(draft)
    weights = eagle3._read(model_dir)
    if any("mask_hidden" in name for name in weights):
        raise ValueError(f"{model_dir}: a DFlash head carries no mask_hidden weight")
    head = DFlashHead(cfg, len(aux_layer_ids(draft)))
    weights = {
        n.replace("midlayer.", "layers.0.")
        .replace("encoder.output_norm_enc.", "hidden_norm.")
        .replace("encoder.fc.", "fc."): v
        for n, v in weights.items()
    }
    eagle3.load_head_weights(head, weights, "DFlash", model_dir, target_vocab_size, compute_dtype)
    head.mask_embedding = _mask_embedding(model_dir, head.mask_token_id, cfg.hidden_size)
    mx.eval(head.parameters())
    return head


def _mask_embedding(model_dir: Path, mask_id: int, size: int) -> mx.array | None:
    """The separately trained mask embedding some checkpoints ship (`mask_embedding.pt`: a
    tensor, or a dict with `embedding` and the `mask_token_id` it is for), as vLLM reads it."""
    path = Path(model_dir) / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_id) != mask_id:
            raise ValueError(
                f"{path}: its mask_token_id {state.get('mask_token_id')} is not the config's "
                f"{mask_id}"
            )
        state = state["embedding"]
    return mx.array(state.float().reshape(size).numpy())
