"""Nemotron-H's MTP step in MLX (`families/nemotron_h_mtp.py`: an attention block, then a MoE
block) over the paged cache equals the step in transformers' float32 modules: a prompt in two
chunks (the second attending to the first's K/V through the pages), then a chained draft step fed
the step's own normed output; a checkpoint without the step, or with a pattern vLLM does not
build, is refused by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import load_model
from vllm_metal.models.families import nemotron_h_mtp

BLOCK = 16


@pytest.fixture(scope="module")
def mtp_dir(tiny_nemotron_h_dir, tmp_path_factory):
    from tests.fixtures.tiny_nemotron_h_mtp import add_mtp_step

    return add_mtp_step(tiny_nemotron_h_dir, tmp_path_factory.mktemp("mtp") / "nemotron_h")


def _target_hidden(model_dir, tokens: list[int]) -> torch.Tensor:
    """The target's final (normed) hidden states in transformers float32, `[n, hidden]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def _run(head, adapter, pool, packed, hidden: mx.array, step: int) -> mx.array:
    cache = layer_caches(pool, packed, head.layer_kinds())[0]
    embeds = adapter.embed(mx.array(packed.token_ids)[:, None])
    return head(embeds, hidden, cache, step)


def test_head_matches_transformers_over_pages(mtp_dir):
    from tests.fixtures.tiny_nemotron_h_mtp import TorchMTP

    tokens = np.random.default_rng(3).integers(16, 700, size=29).tolist()
    n = len(tokens) - 1  # head positions 0..n-1: hidden at p, token at p + 1
    hidden = _target_hidden(mtp_dir, tokens)
    oracle = TorchMTP(mtp_dir)
    want_logits, want_out = oracle(tokens[1:], hidden[:n], list(range(n)))

    adapter = load_model(str(mtp_dir), compute_dtype=mx.float32)
    head = nemotron_h_mtp.load_head(adapter.config, mtp_dir, mx.float32)
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
        outs.append(_run(head, adapter, pool, packed, rows, 0))
    out = mx.concatenate(outs)
    logits = adapter.logits(out).reshape(n, -1)
    np.testing.assert_allclose(np.array(logits), want_logits.numpy(), rtol=1e-4, atol=1e-4)

    # A chained draft: at position n the step takes a draft token and its own output at n - 1.
    draft = int(want_logits[-1].argmax())
    packed = decode_batch(["r"], np.array([n]), np.array([draft]), [table], [BLOCK])
    chained = adapter.logits(_run(head, adapter, pool, packed, out[-1:], 1)).reshape(1, -1)
    fed = torch.cat([hidden[:n], want_out[-1:]])
    want_chained, _ = oracle(tokens[1:] + [draft], fed, list(range(n + 1)))
    np.testing.assert_allclose(np.array(chained)[0], want_chained[-1].numpy(), rtol=1e-4, atol=1e-4)


def test_a_checkpoint_without_the_step_is_refused(tiny_nemotron_h_dir):
    adapter = load_model(str(tiny_nemotron_h_dir), compute_dtype=mx.float32)
    with pytest.raises(ValueError, match=r"declares no MTP layers \(num_nextn_predict_layers\)"):
        nemotron_h_mtp.load_head(adapter.config, tiny_nemotron_h_dir, mx.float32)
    declared = {
        **adapter.config,
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": "*E",
    }
    with pytest.raises(ValueError, match=r"no mtp\.\* weights"):
        nemotron_h_mtp.load_head(declared, tiny_nemotron_h_dir, mx.float32)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mtp_hybrid_override_pattern": "M*E"}, r"MTP pattern 'M\*E' is not served"),
        ({"mtp_hybrid_override_pattern": "*E*E"}, r"MTP pattern '\*E\*E' is not served"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers is 2"),
        ({"mtp_hybrid_override_pattern": None, "mtp_layers_block_type": ["full_attention", "moe"]},
         None),
        ({"mtp_hybrid_override_pattern": None, "mtp_layers_block_type": ["mamba", "moe"]},
         r"MTP pattern 'ME' is not served"),
    ],
)  # fmt: skip
def test_the_served_patterns(fields, message):
    config = {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E", **fields}
    problem = nemotron_h_mtp.missing(config, {})
    if message is None:
        assert problem is None
    else:
        assert problem is not None and __import__("re").search(message, problem), problem
