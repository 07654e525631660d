"""DFlash heads in MLX (`families/dflash.py`): the context K/V written from the target's aux
states over the paged cache (a prompt in two chunks) and the query block [bonus, mask * k] equal
a float32 torch port of vLLM's `DFlashQwen3ForCausalLM` and `DFlashProposer`
(`tests/fixtures/tiny_dflash.py`): logits at the masks and drafts, non-causal and causal heads,
a separately shipped mask embedding (`mask_embedding.pt`),
draft vocabulary and `d2t` included; unfit heads are refused by name."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import torch

from tests.models.test_eagle3 import _hf_aux, _packed
from vllm_metal.backends.mlx.runner.forward import layer_caches
from vllm_metal.backends.mlx.runner.spec_decode.dflash import block_drafts, query_block
from vllm_metal.kv.pool import KVLayout, KVPool
from vllm_metal.models import load_model
from vllm_metal.models.families import dflash
from vllm_metal.models.layers import FULL_ATTENTION

BLOCK = 16
K = 4
TARGET = {"hidden_size": 128, "num_heads": 2, "num_kv_heads": 2, "head_dim": 64}


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return tiny_model_dir("qwen3", **TARGET)


def _mlx_drafts(head, adapter, tokens, aux):
    """The head's logits at the masks and drafts after a context of `tokens`' aux states,
    written in two chunks, then the query block [token after them, mask * K]."""
    num_layers = len(head.layers)
    pool = KVPool(KVLayout.single_group(num_layers, 8, BLOCK), 2, 64, mx.float32)
    kinds = [FULL_ATTENTION] * num_layers
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    n = len(tokens) - 1  # context positions 0..n-1; the bonus is tokens[n]
    for start, end in ((0, 11), (11, n)):
        packed = _packed(tokens, start, end, table)
        head.write_context(aux[start:end], layer_caches(pool, packed, kinds))
    block = query_block(
        ["r"], np.array([n - 1]), np.array([tokens[n]]), K, head.mask_token_id, [table], [BLOCK]
    )
    logits, drafts = block_drafts(head, pool, kinds, block, adapter.embed, adapter.logits)
    return logits, drafts[0]


@pytest.mark.parametrize(
    ("causal", "mask_embedding"), [(False, False), (True, False), (False, True)]
)
def test_head_matches_the_torch_port_over_pages(target_dir, tmp_path, causal, mask_embedding):
    """`mask_embedding`: the checkpoint ships `mask_embedding.pt` for its mask token."""
    from tests.fixtures.tiny_dflash import MASK_TOKEN_ID, TorchDFlash, write_dflash_head

    head_dir = write_dflash_head(target_dir, tmp_path / "h", causal=causal)
    if mask_embedding:
        embedding = torch.randn(TARGET["hidden_size"], generator=torch.Generator().manual_seed(7))
        torch.save(
            {"mask_token_id": MASK_TOKEN_ID, "embedding": embedding},
            head_dir / dflash.MASK_EMBEDDING_FILE,
        )
    config = json.loads((head_dir / "config.json").read_text())
    assert dflash.causal(config) is causal
    tokens = np.random.default_rng(3).integers(16, 700, size=27).tolist()
    aux_ids = dflash.aux_layer_ids(config)
    assert aux_ids == (1, 2)  # target_layer_ids 0, 1: the outputs of layers 0 and 1
    aux = _hf_aux(target_dir, tokens, aux_ids)
    oracle = TorchDFlash(head_dir, target_dir)
    n = len(tokens) - 1
    want_logits, want_drafts = oracle.drafts(aux[:n], tokens[n], K)

    adapter = load_model(str(target_dir), compute_dtype=mx.float32)
    head = dflash.load_head(config, 768, head_dir, mx.float32)
    assert head.d2t is not None and head.lm_head is not None  # a draft vocabulary of 384
    assert (head.mask_embedding is not None) is mask_embedding
    logits, drafts = _mlx_drafts(head, adapter, tokens, mx.array(aux.numpy())[:, None])
    np.testing.assert_allclose(np.array(logits), want_logits.numpy(), rtol=1e-4, atol=1e-4)
    assert np.array(drafts).tolist() == want_drafts.tolist()
    assert all(d % 2 == 0 for d in want_drafts.tolist())  # every other target token
    # The block's attention matters: the other mode gives other logits.
    other, _ = oracle.drafts(aux[:n], tokens[n], K, causal=not causal)
    assert not torch.allclose(other, want_logits, atol=1e-2)


def test_self_drafting_head_drafts_the_pairing_continuation(target_dir, tmp_path):
    """The engine fixture's head (`pairing_target`): all k = LOOKBACK drafts right after a
    period-2 context, through the paged context K/V and the block's positions (a mask past
    LOOKBACK would read an earlier mask)."""
    from tests.fixtures.tiny_dflash import (
        LOOKBACK,
        pairing_prompts,
        pairing_target,
        write_dflash_head,
    )

    target = pairing_target(target_dir, tmp_path / "t")
    head_dir = write_dflash_head(target, tmp_path / "h", self_drafting=True)
    config = json.loads((head_dir / "config.json").read_text())
    (tokens,) = pairing_prompts([23])
    aux = _hf_aux(target, tokens, dflash.aux_layer_ids(config))
    adapter = load_model(str(target), compute_dtype=mx.float32)
    head = dflash.load_head(config, 768, head_dir, mx.float32)
    pool = KVPool(KVLayout.single_group(1, 8, BLOCK), 2, 64, mx.float32)
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    n = len(tokens) - 1
    head.write_context(
        mx.array(aux.numpy())[:n, None],
        layer_caches(pool, _packed(tokens, 0, n, table), [FULL_ATTENTION]),
    )
    k = LOOKBACK
    block = query_block(["r"], np.array([n - 1]), np.array([tokens[n]]), k, 5, [table], [BLOCK])
    _, drafts = block_drafts(head, pool, [FULL_ATTENTION], block, adapter.embed, adapter.logits)
    drafts = np.array(drafts)[0].tolist()
    want = [tokens[n] ^ ((i + 1) % 2) for i in range(k)]  # the tokens at n + 1 .. n + k
    assert drafts == want


def test_unfit_heads_are_refused(target_dir, tmp_path):
    from tests.fixtures.tiny_dflash import write_dflash_head

    head_dir = write_dflash_head(target_dir, tmp_path / "h")
    draft = json.loads((head_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    assert dflash.missing("DFlashDraftModel", draft, target) is None
    assert "not built" in dflash.missing("DFlash2Qwen3ForCausalLM", draft, target)
    assert "'gemma3_text'" in dflash.missing(
        "DFlashDraftModel", draft, {**target, "model_type": "gemma3_text"}
    )
    no_mask = {**draft, "dflash_config": {"target_layer_ids": [0, 1]}}
    assert "names no mask token" in dflash.missing("DFlashDraftModel", no_mask, target)
    no_layers = {**draft, "dflash_config": {"mask_token_id": 5}}
    assert "names no target layers" in dflash.missing("DFlashDraftModel", no_layers, target)
    sinks = {**draft, "dflash_config": {**draft["dflash_config"], "attention_sink_bias": True}}
    assert "sink" in dflash.missing("DFlashDraftModel", sinks, target)
    yarn = {**draft, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    assert "'yarn'" in dflash.missing("DFlashDraftModel", yarn, target)
    (head_dir / "model.safetensors").rename(tmp_path / "moved")
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "moved")
    del weights["d2t"]
    save_file(weights, head_dir / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        dflash.load_head(draft, 768, head_dir, mx.float32)
    del weights["hidden_norm.weight"]
    save_file(weights, head_dir / "model.safetensors")
    draft_same_vocab = {**draft, "draft_vocab_size": 768}
    with pytest.raises(ValueError, match="lacks hidden_norm.weight"):
        dflash.load_head(draft_same_vocab, 768, head_dir, mx.float32)
