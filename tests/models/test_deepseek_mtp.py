"""The MTP layer of DeepSeek-V3 and GLM-4.7-Flash in MLX (`families/deepseek_mtp.py`) over the
paged latent cache equals the layer in transformers' float32 modules: a prompt in two chunks (the
second attending to the first's latent rows through the pages), then a chained draft step fed what
vLLM feeds it (the normed output for DeepSeek-V3, the output before the norm for GLM-4.7-Flash);
the target loads without the MTP layer's tensors; a checkpoint without the layer is refused by
name."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.models import load_model
from vllm_metal.models.families import deepseek_mtp

BLOCK = 16


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe_lite"])
def mtp_dir(request, tmp_path_factory):
    from tests.fixtures.tiny_deepseek_mtp import add_mtp_layer

    src = request.getfixturevalue(f"tiny_{request.param}_dir")
    return add_mtp_layer(src, tmp_path_factory.mktemp("mtp") / request.param)


def _target_hidden(model_dir, tokens: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden states in transformers float32, `[n, hidden]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def _run(head, adapter, pool, packed, hidden: mx.array, step: int):
    caches = layer_caches(pool, packed, head.layer_kinds())
    embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
    return head(embeds, hidden, caches[step % len(caches)], step)


def test_head_matches_transformers_over_pages(mtp_dir):
    from tests.fixtures.tiny_deepseek_mtp import TorchMTP

    tokens = np.random.default_rng(3).integers(16, 700, size=29).tolist()
    n = len(tokens) - 1  # head positions 0..n-1: hidden at p, token at p + 1
    hidden = _target_hidden(mtp_dir, tokens)
    oracle = TorchMTP(mtp_dir)
    want_logits, want_fed = oracle(tokens[1:], hidden[:n], list(range(n)))

    adapter = load_model(str(mtp_dir), compute_dtype=mx.float32)
    head = deepseek_mtp.load_head(adapter.config, mtp_dir, mx.float32)
    kinds = head.layer_kinds()
    pool = pool_for(KVLayout.single_group(1, 8, BLOCK), kinds, 1, 1, mx.float32)
    assert pool.latent and pool.keys[0].shape == (8, BLOCK, 64 + 16)
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    shifted = np.array([tokens[1:] + [0]], dtype=np.int32)
    normed, fed = [], []
    for start, end in ((0, 11), (11, n)):  # the second chunk reads the first's pages
        packed = pack_batch(
            ["r"], {"r": end - start}, np.array([start]), np.array([end]), shifted, [table],
            [BLOCK],
        )  # fmt: skip
        rows = mx.array(hidden[start:end].numpy())[:, None]
        out, back = _run(head, adapter, pool, packed, rows, 0)
        normed.append(out)
        fed.append(back)
    logits = adapter.logits(mx.concatenate(normed)).reshape(n, -1)
    np.testing.assert_allclose(np.array(logits), want_logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        np.array(mx.concatenate(fed))[:, 0], want_fed.numpy(), rtol=1e-4, atol=1e-4
    )

    # A chained draft: at position n the layer takes a draft token and what it fed back at n - 1.
    draft = int(want_logits[-1].argmax())
    packed = decode_batch(["r"], np.array([n]), np.array([draft]), [table], [BLOCK])
    out, _ = _run(head, adapter, pool, packed, fed[-1][-1:], 1)
    chained = adapter.logits(out).reshape(1, -1)
    want_chained, _ = oracle(
        tokens[1:] + [draft], torch.cat([hidden[:n], want_fed[-1:]]), list(range(n + 1))
    )
    np.testing.assert_allclose(np.array(chained)[0], want_chained[-1].numpy(), rtol=1e-4, atol=1e-4)


def test_the_target_loads_without_its_mtp_layer(mtp_dir):
    """mlx-lm's DeepSeek-V3 drops only layer 61; the MTP layer after the tiny model's 3 layers
    is dropped by `deepseek_mtp.sanitize` (mlx-lm's GLM-4.7-Flash drops it itself)."""
    adapter = load_model(str(mtp_dir), compute_dtype=mx.float32)
    assert len(adapter.model.model.layers) == 3


def test_a_checkpoint_without_the_layer_is_refused(tiny_deepseek_v3_dir, tmp_path):
    adapter = load_model(str(tiny_deepseek_v3_dir), compute_dtype=mx.float32)
    with pytest.raises(ValueError, match="declares no MTP layers"):
        deepseek_mtp.load_head(adapter.config, tiny_deepseek_v3_dir, mx.float32)
    # Declared but absent: what an MLX conversion leaves.
    declared = tmp_path / "declared"
    shutil.copytree(tiny_deepseek_v3_dir, declared)
    config = json.loads((declared / "config.json").read_text())
    (declared / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"no model\.layers\.3\.\* tensors for its MTP layer"):
        deepseek_mtp.load_head({**adapter.config, "num_nextn_predict_layers": 1}, declared,
                               mx.float32)  # fmt: skip
