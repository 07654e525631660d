"""EAGLE-3 heads in MLX (`families/eagle3.py`): the target's aux hidden states
(`ModelAdapter.forward_with_aux`, each target family of `eagle3.TARGET_TYPES`) equal the inputs of the named layers
in transformers float32,
and the head over the paged cache (a prompt in two chunks, then a chained draft step fed its own
output) equals a float32 torch port of vLLM's `Eagle3LlamaForCausalLM` / `Eagle3Qwen3ForCausalLM`
(`tests/fixtures/tiny_eagle3.py`), draft vocabulary and `d2t` included; unfit heads are refused
by name."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import load_model
from vllm_metal.models.families import eagle3
from vllm_metal.models.layers import FULL_ATTENTION

BLOCK = 16
AUX = (0, 1, 2)  # the embeddings, layer 0's output, the last layer's output before the norm
TARGET = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 2, "head_dim": 64}


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return tiny_model_dir("qwen3", **TARGET)


def _hf_aux(model_dir, tokens: list[int], layer_ids) -> torch.Tensor:
    """The input of each layer in `layer_ids` (L: the last layer's output), transformers float32,
    joined in layer order: `[n, len(ids) * hidden]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.model.layers
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, k, i=i: seen.__setitem__(i, k.get("hidden_states", a[0] if a else None)),
            with_kwargs=True,
        )
        for i, layer in enumerate(layers)
    ]
    hooks.append(layers[-1].register_forward_hook(
        lambda m, a, out: seen.__setitem__(len(layers), out[0] if isinstance(out, tuple) else out)
    ))  # fmt: skip
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return torch.cat([seen[i][0] for i in sorted(layer_ids)], dim=-1)


def _packed(tokens, start, end, table):
    return pack_batch(
        ["r"], {"r": end - start}, np.array([start]), np.array([end]),
        np.array([tokens], dtype=np.int32), [table], [BLOCK],
    )  # fmt: skip


def _target(tiny_model_dir, arch: str, tmp_path):
    """A tiny target of each of vLLM's EAGLE-3 target families built here (`TARGET_TYPES`)."""
    if arch == "qwen3_moe":
        from tests.fixtures.tiny_moe import write_tiny_moe

        return write_tiny_moe(tmp_path / arch, arch)
    if arch == "gpt_oss":
        from tests.fixtures.tiny_gpt_oss import write_tiny_gpt_oss

        return write_tiny_gpt_oss(tmp_path / arch)
    return tiny_model_dir(arch, **TARGET)


@pytest.mark.parametrize("arch", eagle3.TARGET_TYPES)
def test_target_keeps_the_aux_states_of_transformers(tiny_model_dir, tmp_path, arch):
    target_dir = _target(tiny_model_dir, arch, tmp_path)
    tokens = np.random.default_rng(1).integers(16, 700, size=21).tolist()
    adapter = load_model(str(target_dir), compute_dtype=mx.float32)
    adapter.install_paged_attention()
    kinds = adapter.layer_kinds()
    cfg = json.loads((target_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layout = KVLayout.single_group(len(kinds), 8, BLOCK)
    pool = KVPool(layout, cfg["num_key_value_heads"], head_dim, mx.float32)
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    got = []
    for start, end in ((0, 9), (9, len(tokens))):
        packed = _packed(tokens, start, end, table)
        caches = layer_caches(pool, packed, kinds)
        embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
        _, aux = adapter.forward_with_aux(embeds, caches, AUX)
        got.append(np.array(aux)[:, 0])
    want = _hf_aux(target_dir, tokens, AUX).numpy()
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(("arch", "num_layers"), [("llama", 1), ("qwen3", 2)])
def test_head_matches_the_torch_port_over_pages(target_dir, tmp_path, arch, num_layers):
    from tests.fixtures.tiny_eagle3 import TorchEagle3, write_eagle3_head

    head_dir = write_eagle3_head(target_dir, tmp_path / arch, arch=arch, num_layers=num_layers)
    config = json.loads((head_dir / "config.json").read_text())
    tokens = np.random.default_rng(3).integers(16, 700, size=26).tolist()
    n = len(tokens) - 1  # head positions 0..n-1: aux states at p, token at p + 1
    oracle = TorchEagle3(head_dir, target_dir)
    fc_out = oracle.combine(_hf_aux(target_dir, tokens, AUX))[:n]
    want_logits, want_out = oracle.forward(tokens[1:], fc_out, list(range(n)))

    architecture = "LlamaForCausalLMEagle3" if arch == "llama" else "Eagle3Qwen3ForCausalLM"
    adapter = load_model(str(target_dir), compute_dtype=mx.float32)
    head = eagle3.load_head(architecture, config, 2, 768, head_dir, mx.float32)
    assert head.d2t is not None and head.lm_head is not None  # a draft vocabulary of 384
    pool = KVPool(KVLayout.single_group(num_layers, 8, BLOCK), 2, 64, mx.float32)
    kinds = [FULL_ATTENTION] * num_layers
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    shifted = tokens[1:] + [0]
    aux = mx.array(_hf_aux(target_dir, tokens, AUX).numpy())[:, None]
    normed, hidden = [], []
    for start, end in ((0, 11), (11, n)):  # the second chunk reads the first's pages
        packed = _packed(shifted, start, end, table)
        embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
        out = head(embeds, head.combine(aux[start:end]), layer_caches(pool, packed, kinds))
        normed.append(out[0])
        hidden.append(out[1])
    logits = head.lm_head(mx.concatenate(normed)).reshape(n, -1)
    np.testing.assert_allclose(np.array(logits), want_logits.numpy(), rtol=1e-4, atol=1e-4)
    hidden = mx.concatenate(hidden)
    np.testing.assert_allclose(np.array(hidden)[:, 0], want_out.numpy(), rtol=1e-4, atol=1e-4)
    draft = int(oracle.to_target(want_logits[-1].argmax()))
    assert int(head.draft_tokens(logits[-1:])[0]) == draft
    assert draft % 2 == 0  # the draft vocabulary is every other target token

    # A chained draft: at position n the head takes the draft and its own output at n - 1.
    packed = decode_batch(["r"], np.array([n]), np.array([draft]), [table], [BLOCK])
    embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
    out, _ = head(embeds, hidden[-1:], layer_caches(pool, packed, kinds))
    chained = head.lm_head(out).reshape(1, -1)
    fed = torch.cat([fc_out, want_out[-1:]])
    want_chained, _ = oracle.forward(tokens[1:] + [draft], fed, list(range(n + 1)))
    np.testing.assert_allclose(np.array(chained)[0], want_chained[-1].numpy(), rtol=1e-4, atol=1e-4)


def test_unfit_heads_are_refused(target_dir, tmp_path):
    from tests.fixtures.tiny_eagle3 import write_eagle3_head

    head_dir = write_eagle3_head(target_dir, tmp_path / "h")
    draft = json.loads((head_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    assert eagle3.missing("LlamaForCausalLMEagle3", draft, target) is None
    assert "not built" in eagle3.missing("Eagle3DeepseekV2ForCausalLM", draft, target)
    assert "'gemma3_text'" in eagle3.missing(
        "LlamaForCausalLMEagle3", draft, {**target, "model_type": "gemma3_text"}
    )
    # Every layer windowed, as the tiny Mistral's.
    windowed = {**target, "sliding_window": 32, "use_sliding_window": True, "layer_types": None}
    assert "no full-attention layer" in eagle3.missing("LlamaForCausalLMEagle3", draft, windowed)
    mixed = {**windowed, "layer_types": ["sliding_attention", "full_attention"]}
    assert eagle3.missing("LlamaForCausalLMEagle3", draft, mixed) is None
    far = {**draft, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5]}}
    assert "outside the target's 0..2" in eagle3.missing("LlamaForCausalLMEagle3", far, target)
    (head_dir / "model.safetensors").rename(tmp_path / "moved")
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "moved")
    del weights["d2t"]
    save_file(weights, head_dir / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        eagle3.load_head("LlamaForCausalLMEagle3", draft, 2, 768, head_dir, mx.float32)
