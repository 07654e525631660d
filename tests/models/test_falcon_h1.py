"""Proves the plugin's loader reads Falcon-H1 checkpoints into a model whose float32 logits equal
transformers' where stock mlx-lm's do not (the key multiplier, the values' attention-input
multiplier, the gated RMSNorm per group, output multipliers on biases), for Hugging Face
checkpoints of several layouts and one converted by mlx-lm, and that each decoder layer declares
two memory layers (attention, then its Mamba-2 mixer); in process, no engine."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from vllm_metal.models.layers import StateShapes

PROMPT = [101, 57, 402, 33, 250, 610, 75, 18, 499, 321, 48, 207]
# The tiny checkpoint's mixers: 8 heads of 16, state 16; the conv window runs over x (128) and
# B, C (2 groups of 16 each).
TINY_STATE = StateShapes(conv=(3, 192), recurrent=(8, 16, 16), mixer="mamba2")
# Config changes that take the other code paths of the published configs' options.
VARIANTS = {
    # The gate without the norm, a tied head, and a bias on every projection that has one.
    "gate_only_tied_biases": {
        "mamba_rms_norm": False,
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
        "mamba_proj_bias": True,
        "projectors_bias": True,
    },
    "norm_before_gate": {"mamba_norm_before_gate": True},
}


def _load(path: Path):
    from vllm_metal.models import load_model

    hf_config = json.loads((path / "config.json").read_text())
    return load_model(str(path), compute_dtype=mx.float32, hf_config=hf_config)


def _logits(adapter) -> np.ndarray:
    """mlx-lm's own (unpaged) forward of the loaded model: what loading alone decides."""
    return np.array(adapter.model(mx.array([PROMPT]))[0].astype(mx.float32))


def _assert_transformers_logits(ours: np.ndarray, path: Path) -> None:
    from tests.fixtures.oracles import hf_logits

    ref = hf_logits(path, PROMPT)
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_the_tiny_checkpoint_loads_to_transformers_logits_where_mlx_lm_departs(tiny_falcon_h1_dir):
    from mlx_lm import load

    from tests.fixtures.oracles import hf_logits
    from vllm_metal.models.hf_config import checkpoint_overrides

    adapter = _load(tiny_falcon_h1_dir)
    _assert_transformers_logits(_logits(adapter), tiny_falcon_h1_dir)

    stock, _ = load(str(tiny_falcon_h1_dir), model_config=checkpoint_overrides(tiny_falcon_h1_dir))
    stock_logits = np.array(stock(mx.array([PROMPT]))[0].astype(mx.float32))
    assert np.abs(stock_logits - hf_logits(tiny_falcon_h1_dir, PROMPT)).max() > 0.5


def test_each_memory_layer_is_named_and_kinded_in_decoder_order(tiny_falcon_h1_dir):
    adapter = _load(tiny_falcon_h1_dir)
    kinds = adapter.layer_kinds()
    assert adapter.num_layers == 2
    assert [k.label for k in kinds] == ["full", "state", "full", "state"]
    assert kinds[1].state == kinds[3].state == TINY_STATE
    assert adapter.attention_layer_names == [
        "model.layers.0.self_attn",
        "model.layers.0.mamba",
        "model.layers.1.self_attn",
        "model.layers.1.mamba",
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_layouts_load_to_transformers_logits(tmp_path, variant):
    from tests.fixtures.tiny_falcon_h1 import write_tiny_falcon_h1

    path = write_tiny_falcon_h1(tmp_path / variant, **VARIANTS[variant])
    _assert_transformers_logits(_logits(_load(path)), path)


def test_a_checkpoint_converted_by_mlx_lm_loads_to_transformers_logits(
    tiny_falcon_h1_dir, tmp_path
):
    """mlx-lm's converter folds the multipliers it knows into the weights and writes the conv
    kernels in MLX's layout; the plugin's corrections apply to that as to the original."""
    import contextlib
    import io

    from mlx_lm.convert import convert

    converted = tmp_path / "mlx"
    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(tiny_falcon_h1_dir), str(converted), dtype="float32")
    assert json.loads((converted / "config.json").read_text())["key_multiplier"] == 0.5
    _assert_transformers_logits(_logits(_load(converted)), tiny_falcon_h1_dir)


def test_a_config_without_its_multipliers_is_refused_naming_them(tiny_falcon_h1_dir):
    from vllm_metal.models.families.falcon_h1 import Adapter

    config = json.loads((tiny_falcon_h1_dir / "config.json").read_text())
    del config["key_multiplier"], config["ssm_multipliers"]
    with pytest.raises(ValueError, match="lacks key_multiplier, ssm_multipliers"):
        Adapter(None, config)
