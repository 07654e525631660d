"""Proves the plugin's loader reads every published Qwen3.5 layout (the dense and MoE wrappers, the
text-only `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` whose model types mlx-lm does not know, per-expert MoE tensors that stock
mlx-lm cannot read) into a model whose float32 logits equal transformers', with the layer kinds
and state shapes the KV specs are built from; in process, no engine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.models.layers import StateShapes

PROMPT = [101, 57, 402, 33, 250, 610, 75, 18, 499, 321, 48, 207]
# The tiny checkpoints' linear layers: 2 value heads of 64 x 64 float32 keys, a conv window of
# 3 x (2 * 64 + 2 * 64).
TINY_STATE = StateShapes(conv=(3, 256), recurrent=(2, 64, 64))


@pytest.mark.parametrize("layout", ["wrapper", "causal_lm", "moe_wrapper", "moe_causal_lm"])
def test_each_layout_loads_to_transformers_logits(tiny_qwen3_5_dirs, layout):
    import json

    from tests.fixtures.oracles import hf_logits
    from vllm_metal.models import load_model

    path = tiny_qwen3_5_dirs(layout)
    hf_config = json.loads((path / "config.json").read_text())
    adapter = load_model(str(path), compute_dtype=mx.float32, hf_config=hf_config)

    kinds = adapter.layer_kinds()
    assert [k.label for k in kinds] == ["state", "state", "state", "full"]
    assert all(k.state == TINY_STATE for k in kinds[:3])
    assert adapter.attention_layer_names == [
        "model.layers.0.linear_attn",
        "model.layers.1.linear_attn",
        "model.layers.2.linear_attn",
        "model.layers.3.self_attn",
    ]
    # mlx-lm's own (unpaged) forward of the loaded model: what loading alone decides.
    ours = np.array(adapter.model(mx.array([PROMPT]))[0].astype(mx.float32))
    ref = hf_logits(path, PROMPT)
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_per_expert_tensors_are_stacked_in_expert_order():
    from vllm_metal.models.families.qwen3_5 import sanitize

    prefix = "model.language_model.layers.0.mlp"
    weights = {
        f"{prefix}.experts.{e}.{proj}.weight": mx.full((2, 3), 10 * e + p)
        for e in (1, 0, 2)
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj"))
    }
    weights[f"{prefix}.gate.weight"] = mx.zeros((3, 2))
    out = sanitize(weights)
    assert sorted(out) == [
        f"{prefix}.gate.weight",
        *(f"{prefix}.switch_mlp.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")),
    ]
    stacked = np.array(out[f"{prefix}.switch_mlp.up_proj.weight"])
    assert stacked.shape == (3, 2, 3)
    assert stacked[:, 0, 0].tolist() == [1, 11, 21]
