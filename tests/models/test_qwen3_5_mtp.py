"""Qwen3.5's MTP head in MLX (`families/qwen3_5_mtp.py`, dense and MoE) over the paged cache equals
the head in transformers' float32 modules: a prompt in two chunks (the second attending to the first's K/V
through the pages), then a chained draft step fed the head's own output; and a checkpoint
without the head is refused by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import load_model
from vllm_metal.models.families import qwen3_5_mtp
from vllm_metal.models.layers import FULL_ATTENTION

BLOCK = 16


@pytest.fixture(scope="module", params=["causal_lm", "moe_causal_lm"])
def mtp_dir(request, tiny_qwen3_5_dirs, tmp_path_factory):
    """A text-only tiny Qwen3.5 (dense, MoE) with a random MTP head."""
    from tests.fixtures.tiny_qwen3_5_mtp import add_mtp_head

    src = tiny_qwen3_5_dirs(request.param)
    return add_mtp_head(src, tmp_path_factory.mktemp("mtp") / request.param)


def _target_hidden(model_dir, tokens: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden states in transformers float32, `[n, hidden]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def test_head_matches_transformers_over_pages(mtp_dir):
    from tests.fixtures.tiny_qwen3_5_mtp import TorchMTP

    tokens = np.random.default_rng(3).integers(16, 700, size=29).tolist()
    n = len(tokens) - 1  # head positions 0..n-1: hidden at p, token at p + 1
    hidden = _target_hidden(mtp_dir, tokens)
    oracle = TorchMTP(mtp_dir)
    want_logits, want_out = oracle(tokens[1:], hidden[:n], list(range(n)))

    adapter = load_model(str(mtp_dir), compute_dtype=mx.float32)
    head = qwen3_5_mtp.load_head(adapter.config, mtp_dir, mx.float32)
    heads, dim = adapter.config["num_key_value_heads"], adapter.config["head_dim"]
    pool = KVPool(KVLayout.single_group(1, 8, BLOCK), heads, dim, mx.float32)
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    shifted = np.array([tokens[1:] + [0]], dtype=np.int32)
    outs = []
    for start, end in ((0, 11), (11, n)):  # the second chunk reads the first's pages
        packed = pack_batch(
            ["r"], {"r": end - start}, np.array([start]), np.array([end]), shifted, [table],
            [BLOCK],
        )  # fmt: skip
        rows = mx.array(hidden[start:end].numpy())[:, None]
        embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
        outs.append(head(embeds, rows, layer_caches(pool, packed, [FULL_ATTENTION])[0], 0))
    out = mx.concatenate(outs)
    logits = adapter.logits(out).reshape(n, -1)
    np.testing.assert_allclose(np.array(logits), want_logits.numpy(), rtol=1e-4, atol=1e-4)

    # A chained draft: at position n the head takes a draft token and its own output at n - 1.
    draft = int(want_logits[-1].argmax())
    packed = decode_batch(["r"], np.array([n]), np.array([draft]), [table], [BLOCK])
    embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
    cache = layer_caches(pool, packed, [FULL_ATTENTION])[0]
    chained = adapter.logits(head(embeds, out[-1:], cache, 1)).reshape(1, -1)
    fed = torch.cat([hidden[:n], want_out[-1:]])
    want_chained, _ = oracle(tokens[1:] + [draft], fed, list(range(n + 1)))
    np.testing.assert_allclose(np.array(chained)[0], want_chained[-1].numpy(), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_without_the_head_is_refused(tiny_qwen3_5_causal_lm_dir):
    adapter = load_model(str(tiny_qwen3_5_causal_lm_dir), compute_dtype=mx.float32)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        qwen3_5_mtp.load_head(adapter.config, tiny_qwen3_5_causal_lm_dir, mx.float32)
    config = {**adapter.config, "mtp_num_hidden_layers": 1}
    with pytest.raises(ValueError, match=r"no mtp\.\* weights"):
        qwen3_5_mtp.load_head(config, tiny_qwen3_5_causal_lm_dir, mx.float32)
