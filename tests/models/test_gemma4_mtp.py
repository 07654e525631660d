"""Gemma 4's MTP assistant in MLX (`families/gemma4_mtp.py`), attending over the tiny Gemma 4 target's
K/V in the paged pool (a prompt prefilled in two chunks, longer than the sliding window), equals
the assistant in transformers' float32 modules fed the target's `shared_kv_states`: logits and
projected output at several positions, a chained draft step fed its own output, and with ordered
embeddings the same candidate tokens and argmax; an assistant that does not fit its target is
refused by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from vllm_metal.backends.mlx.runner.batch import decode_batch, pack_batch
from vllm_metal.backends.mlx.runner.forward import hidden_states, layer_caches
from vllm_metal.kv.pool import KVLayout, pool_for
from vllm_metal.models import load_model
from vllm_metal.models.families import gemma4_mtp
from vllm_metal.models.layers import memory_layers

BLOCK = 16
# The K/V the assistant reads are the MLX target's, which are ~3e-4 off transformers' in float32
# (as the target's own logits: `test_gemma4.LOGPROB_TOL`).
TOL = {"rtol": 1e-3, "atol": 1e-3}


@pytest.fixture(
    scope="module",
    params=[
        ("dense", "plain"),
        ("dense", "ordered"),
        pytest.param(("moe", "plain"), marks=pytest.mark.full),
    ],
    ids=["dense", "dense-ordered", "moe"],
)
def pair(request, tmp_path_factory):
    """(target, assistant): the E2B-like target, or (`full`) the 26B-A4B-like one whose full
    layers' values are their keys (one KV head)."""
    from tests.fixtures.tiny_gemma4_mtp import write_assistant

    variant, head = request.param
    target = request.getfixturevalue(
        "tiny_gemma4_dir" if variant == "dense" else "tiny_gemma4_moe_dir"
    )
    out = tmp_path_factory.mktemp("gemma4-assistant") / f"{variant}-{head}"
    return target, write_assistant(target, out, ordered=head == "ordered")


def _paged_target(target_dir):
    """The target in MLX with a prompt's K/V written to its pool in two chunks."""
    tokens = np.random.default_rng(5).integers(16, 700, size=27).tolist()
    adapter = load_model(str(target_dir), compute_dtype=mx.float32)
    adapter.install_paged_attention()
    kinds = adapter.layer_kinds()
    layout = KVLayout.single_group(len(kinds), 8, BLOCK, memory_layers(kinds))
    pool = pool_for(layout, kinds, 2, 32, mx.float32)
    table = np.array([[1, 2, 3, 4]], dtype=np.int32)
    n = len(tokens)
    for start, end in ((0, 10), (10, n)):
        packed = pack_batch(
            ["r"], {"r": end - start}, np.array([start]), np.array([n]),
            np.array([tokens], dtype=np.int32), [table], [BLOCK],
        )  # fmt: skip
        mx.eval(hidden_states(adapter, pool, kinds, packed), *pool.arrays())
    return adapter, kinds, pool, table, tokens


def _assistant_step(adapter, kinds, pool, table, assistant, sources, token, hidden, position):
    packed = decode_batch(["r"], np.array([position]), np.array([token]), [table], [BLOCK])
    caches = layer_caches(pool, packed, kinds)
    embeds = adapter.embed(mx.array([[token]]))
    inputs = mx.concatenate([embeds, mx.array(hidden.numpy())[None, None]], axis=-1)
    return assistant(inputs, [caches[i] for i in sources])


def test_assistant_over_the_target_pages_matches_transformers(pair):
    from tests.fixtures.tiny_gemma4_mtp import TorchDrafts

    target_dir, assistant_dir = pair
    adapter, kinds, pool, table, tokens = _paged_target(target_dir)
    oracle = TorchDrafts(target_dir, assistant_dir)
    hidden, kv = oracle.target_states(tokens)
    assistant, sources = gemma4_mtp.load_assistant(assistant_dir, adapter.config, mx.float32)
    # The last sliding and the last full target layer with K/V of their own.
    own = [i for i, kind in enumerate(kinds) if kind.kv_source is None]
    sliding = max(i for i in own if kinds[i].sliding_window is not None)
    assert sources == [sliding, max(i for i in own if kinds[i].sliding_window is None)]
    for position in (3, 15, len(tokens) - 2):  # inside the window, past it, at the end
        token = tokens[position + 1]
        want_logits, want_state = oracle.step(token, hidden[position], kv, position)
        out, state = _assistant_step(
            adapter, kinds, pool, table, assistant, sources, token, hidden[position], position
        )
        _assert_logits(assistant.logits(out)[0], want_logits)
        np.testing.assert_allclose(np.array(state)[0, 0], want_state.numpy(), **TOL)
        assert int(assistant.argmax(out)[0]) == int(want_logits.argmax())

        # The next draft step: the draft and the assistant's own output, at the same position.
        draft = int(want_logits.argmax())
        want_logits, _ = oracle.step(draft, want_state, kv, position)
        out, _ = _assistant_step(
            adapter, kinds, pool, table, assistant, sources, draft, want_state, position
        )
        _assert_logits(assistant.logits(out)[0], want_logits)


def test_suppressed_tokens_are_never_drafted(pair, tmp_path):
    """The assistant's generation config's `suppress_tokens` (vLLM masks them in its logits)."""
    import json
    import shutil

    from tests.fixtures.tiny_gemma4_mtp import TorchDrafts

    target_dir, assistant_dir = pair
    adapter, kinds, pool, table, tokens = _paged_target(target_dir)
    hidden, _ = TorchDrafts(target_dir, assistant_dir).target_states(tokens)
    position = len(tokens) - 2
    step = (adapter, kinds, pool, table)
    assistant, sources = gemma4_mtp.load_assistant(assistant_dir, adapter.config, mx.float32)
    out, _ = _assistant_step(*step, assistant, sources, tokens[-1], hidden[position], position)
    logits = np.array(assistant.logits(out)[0])
    first, second = np.argsort(-logits)[:2]

    suppressed = tmp_path / "suppressed"
    shutil.copytree(assistant_dir, suppressed)
    (suppressed / "generation_config.json").write_text(
        json.dumps({"suppress_tokens": [int(first)]})
    )
    assistant, _ = gemma4_mtp.load_assistant(suppressed, adapter.config, mx.float32)
    out, _ = _assistant_step(*step, assistant, sources, tokens[-1], hidden[position], position)
    assert int(assistant.argmax(out)[0]) == second
    assert np.isneginf(np.array(assistant.logits(out)[0])[first])


def _assert_logits(got: mx.array, want: torch.Tensor) -> None:
    """Equal logits; where the assistant scores only some tokens (ordered embeddings), the same
    ones (transformers fills the others with a value below them all)."""
    got, want = np.array(got), want.numpy()
    scored = np.isfinite(got)
    assert (want[~scored] < want[scored].min()).all()
    np.testing.assert_allclose(got[scored], want[scored], **TOL)


def test_an_assistant_that_does_not_fit_its_target_is_refused(tiny_gemma4_dir, tmp_path):
    from tests.fixtures.tiny_gemma4_mtp import write_assistant

    target = load_model(str(tiny_gemma4_dir), compute_dtype=mx.float32).config
    assistant = write_assistant(tiny_gemma4_dir, tmp_path / "a")
    config = gemma4_mtp.read_config(assistant)
    assert gemma4_mtp.missing(target, config) is None
    wider = {**target, "hidden_size": 128}
    with pytest.raises(ValueError, match="backbone_hidden_size 64 is not the target's hidden_size"):
        gemma4_mtp.load_assistant(assistant, wider, mx.float32)
    fewer_heads = {**config, "text_config": {**config["text_config"], "num_key_value_heads": 1}}
    assert "expects K/V of 1 heads of 32" in gemma4_mtp.missing(target, fewer_heads)
    only_sliding = {**target, "num_kv_shared_layers": 4}  # no full layer with K/V of its own
    assert "no full_attention layer with K/V" in gemma4_mtp.missing(only_sliding, config)


def test_every_assistant_layer_reads_the_target_whatever_its_config_says(tiny_gemma4_dir, tmp_path):
    """transformers makes every assistant layer KV-shared when `num_kv_shared_layers` is unset
    or 0; the loader does the same."""
    import json

    from tests.fixtures.tiny_gemma4_mtp import write_assistant

    target = load_model(str(tiny_gemma4_dir), compute_dtype=mx.float32).config
    assistant = write_assistant(tiny_gemma4_dir, tmp_path / "a")
    config = json.loads((assistant / "config.json").read_text())
    config["text_config"]["num_kv_shared_layers"] = 0
    (assistant / "config.json").write_text(json.dumps(config))
    loaded, _ = gemma4_mtp.load_assistant(assistant, target, mx.float32)
    assert not any(layer.self_attn.has_kv for layer in loaded.layers)
