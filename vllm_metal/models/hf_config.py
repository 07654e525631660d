"""Config keys that transformers 5 writes under other names than mlx-lm reads them.

transformers 5 saves a checkpoint's RoPE base only inside `rope_parameters` (no top-level
`rope_theta`; keyed by layer type for families with sliding layers, e.g. OLMo 3), and its Qwen3-MoE config names the expert count `num_local_experts` (with
`num_experts` an attribute alias that `save_pretrained` does not write). mlx-lm 0.32.2's `ModelArgs`
read the top-level `rope_theta`, for Qwen3-MoE and Qwen2-MoE `num_experts`, and for GLM-4.7-Flash
the count of dense layers before the MoE ones, `first_k_dense_replace` (transformers 5 writes the
per-layer `mlp_layer_types` instead), for Gemma 4 the full-attention layers' `global_head_dim` and
`num_global_key_value_heads` (transformers 5 writes them per layer, `per_layer_config`), and for a
Gemma 4 wrapper its vocabulary size (only in `text_config`): where the field is
required the load fails ("missing 2 required positional arguments"), where it has a default
(Mixtral's and Qwen2-MoE's `rope_theta` = 1e6) the model silently runs with the wrong RoPE base.
Checkpoints published on the hub carry mlx-lm's names; a checkpoint saved (fine-tuned, converted)
with transformers 5 carries only the new ones.

`mlx_lm_overrides` fills such a key from its transformers 5 form, only when the config lacks it and
the architecture's `ModelArgs` takes it; a config that already has the key is left alone. The
loader hands the result to mlx-lm's `load_model(model_config=...)`. RoPE scaling kept only in
`rope_parameters` (its `rope_type` other than "default", with its factors) becomes mlx-lm's
`rope_scaling`, and None for plain RoPE where mlx-lm requires the field (EXAONE 4.0); mlx-lm's
Qwen3-MoE ignores `rope_scaling` altogether.
"""

from __future__ import annotations

import inspect
from typing import Any

# mlx-lm ModelArgs field -> where transformers 5 keeps it
_RENAMED = {"num_experts": "num_local_experts"}


def mlx_lm_overrides(config: dict[str, Any], args_class: type) -> dict[str, Any]:
    """The keys to add to `config` before mlx-lm builds `args_class` from it (often none)."""
    takes = inspect.signature(args_class).parameters
    out: dict[str, Any] = {}
    text = config.get("text_config")
    if "text_config" not in takes and isinstance(text, dict) and "hidden_size" not in config:
        # A wrapper whose language model mlx-lm reads as a text model (Qwen3-ASR as `qwen3`):
        # the text model's keys at the top level.
        out = {k: v for k, v in text.items() if k in takes and k not in config}
        return out | mlx_lm_overrides({**config, **out}, args_class)
    if "rope_theta" in takes and "rope_theta" not in config:
        base = _rope_base(config.get("rope_parameters"))
        if base is not None:
            out["rope_theta"] = base
    if "rope_scaling" in takes and "rope_scaling" not in config:
        scaling = _rope_scaling(config.get("rope_parameters"))
        if scaling is not None or takes["rope_scaling"].default is inspect.Parameter.empty:
            out["rope_scaling"] = scaling
    for field, source in _RENAMED.items():
        if field in takes and field not in config and source in config:
            out[field] = config[source]
    mlp_types = config.get("mlp_layer_types")
    if "first_k_dense_replace" in takes and "first_k_dense_replace" not in config and mlp_types:
        out["first_k_dense_replace"] = _dense_prefix(mlp_types)
    for field, value in global_attention(config).items():
        if field in takes and field not in config:
            out[field] = value
    if "text_config" in takes and isinstance(config.get("text_config"), dict):
        # A wrapper whose mlx-lm class builds its text model's args from `text_config` (Gemma 4,
        # whose wrapper args also overwrite the text model's vocabulary size with their own).
        text = config["text_config"]
        if "vocab_size" in takes and "vocab_size" not in config and "vocab_size" in text:
            out["vocab_size"] = text["vocab_size"]
        text_args = _text_args_class(text)
        inner = {} if text_args is None else mlx_lm_overrides(text, text_args)
        if inner:
            out["text_config"] = {**text, **inner}
    return out


def global_attention(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's full-attention head size and KV heads from transformers 5's `per_layer_config`
    (layer index -> overrides, the same for every full-attention layer)."""
    overrides = [layer for layer in (config.get("per_layer_config") or {}).values() if layer]
    out: dict[str, Any] = {}
    for field, source in (
        ("global_head_dim", "head_dim"),
        ("num_global_key_value_heads", "num_key_value_heads"),
    ):
        values = {layer[source] for layer in overrides if source in layer}
        if len(values) > 1:
            raise ValueError(
                f"vllm-metal: per_layer_config gives full-attention layers {source} "
                f"{sorted(values)}; mlx-lm builds one {field}"
            )
        if values:
            out[field] = values.pop()
    return out


def _text_args_class(text: dict[str, Any]) -> type | None:
    """The mlx-lm `ModelArgs` of a wrapper's `text_config` (None where mlx-lm has no module for
    its model type)."""
    from mlx_lm.utils import _get_classes

    from vllm_metal.models.families import family_classes

    try:
        return family_classes(_get_classes)(text)[1]
    except ValueError:
        return None


def _dense_prefix(mlp_types: list[str]) -> int:
    """How many dense layers come before the MoE ones, for a model whose layers are dense then
    sparse (the only pattern `first_k_dense_replace` expresses)."""
    dense = next((i for i, t in enumerate(mlp_types) if t != "dense"), len(mlp_types))
    if any(t != "sparse" for t in mlp_types[dense:]):
        raise ValueError(
            f"vllm-metal: mlp_layer_types {mlp_types} is not a run of 'dense' layers followed by "
            "'sparse' ones, the only layout mlx-lm builds (first_k_dense_replace)"
        )
    return dense


def _rope_scaling(rope: Any) -> dict[str, Any] | None:
    """mlx-lm's `rope_scaling` from one `rope_parameters` (its scaling type and factors; None for
    plain RoPE, and for parameters keyed by layer type)."""
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return None
    if rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def _rope_base(rope: Any) -> float | None:
    """The one RoPE base of `rope_parameters`: its `rope_theta`, or the `rope_theta` every layer
    type shares when it is keyed by layer type (OLMo 3); None when the layer types differ
    (Gemma 3's local and global bases, which mlx-lm reads under other names)."""
    if not isinstance(rope, dict):
        return None
    if "rope_theta" in rope:
        return rope["rope_theta"]
    bases = {p.get("rope_theta") for p in rope.values() if isinstance(p, dict)}
    return bases.pop() if len(bases) == 1 and None not in bases else None


def checkpoint_overrides(path: Any) -> dict[str, Any] | None:
    """`mlx_lm_overrides` for the checkpoint directory `path` (None when there are none, and for
    configs naming their own model code, which mlx-lm's class lookup does not cover)."""
    from mlx_lm.utils import _get_classes, load_config

    from vllm_metal.models.families import family_classes

    config = load_config(path)
    if "model_file" in config:
        return None
    return mlx_lm_overrides(config, family_classes(_get_classes)(config)[1]) or None
