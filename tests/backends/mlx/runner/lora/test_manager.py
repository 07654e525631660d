"""The LoRA pieces in process, on a tiny mlx-lm model: the batched update against per-row numpy,
adapter reading and its refusals, slot and host-cache eviction, and a quantized base (the
`QuantizedLinear` path the Mac serves) against mlx-lm's own `LoRALinear`."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from vllm.config.lora import LoRAConfig
from vllm.exceptions import LoRAAdapterNotFoundError
from vllm.lora.request import LoRARequest

from tests.fixtures.oracles import apply_peft_with_mlx_lm, load_hf_model
from tests.fixtures.tiny_lora import write_tiny_adapter
from vllm_metal.backends.mlx.runner.lora.checkpoint import AdapterError, read_adapter
from vllm_metal.backends.mlx.runner.lora.layer import LoRALinear, StepMask
from vllm_metal.backends.mlx.runner.lora.manager import LoRAManager

RANK = 8


def test_rows_of_different_adapters_get_their_own_update():
    rng = np.random.default_rng(0)
    in_f, out_f, slots = 12, 10, 3
    base = nn.Linear(in_f, out_f, bias=True)
    step = StepMask()
    layer = LoRALinear(base, (in_f, out_f), slots * RANK, mx.float32, step)
    deltas = []
    for s, rank in enumerate([RANK, 3, 5]):  # smaller ranks are padded within their block
        a = rng.standard_normal((in_f, rank)).astype(np.float32)
        b = rng.standard_normal((rank, out_f)).astype(np.float32)
        layer.write(slice(s * RANK, (s + 1) * RANK), mx.array(a), mx.array(b))
        deltas.append((a, b))
    x = rng.standard_normal((5, 1, in_f)).astype(np.float32)
    token_slots = np.array([2, -1, 0, 1, 2])  # -1: a base-model token
    block = np.arange(slots * RANK) // RANK
    step.rows = slice(0, slots * RANK)
    step.mask = mx.array((block[None] == token_slots[:, None]).astype(np.float32))[:, None]
    got = np.array(layer(mx.array(x)))

    w, bias = np.array(base.weight), np.array(base.bias)
    for t, s in enumerate(token_slots):
        want = x[t] @ w.T + bias
        if s >= 0:
            a, b = deltas[s]
            want = want + x[t] @ a @ b
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5)
    step.clear()
    np.testing.assert_array_equal(np.array(layer(mx.array(x))), np.array(base(mx.array(x))))


@pytest.fixture(scope="module")
def llama(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora-unit")
    adapters = {
        name: write_tiny_adapter(model, root / name, rank=RANK, seed=seed)
        for seed, name in enumerate(["a", "b", "c"])
    }
    return model, adapters


def _manager(model_dir, max_loras=2, max_cpu_loras=2, **kwargs):
    from mlx_lm import load

    model, _ = load(str(model_dir))
    config = LoRAConfig(
        max_lora_rank=16, max_loras=max_loras, max_cpu_loras=max_cpu_loras, **kwargs
    )
    manager = LoRAManager(config, mx.float32)
    manager.wrap(model)
    return model, manager


def _request(name, lora_id, path):
    return LoRARequest(name, lora_id, str(path))


def test_wrapped_model_with_an_adapter_matches_the_peft_merged_model(llama):
    import torch

    model_dir, adapters = llama
    model, manager = _manager(model_dir)
    request = _request("a", 1, adapters["a"])
    tokens = [5, 100, 200, 300, 17, 42]
    manager.prepare(np.array([1]), {1: request}, np.array([len(tokens)]))
    assert manager.step.mask is None  # one adapter for every token: its block, no mask
    got = np.array(model(mx.array([tokens])))[0]
    with torch.no_grad():
        want = load_hf_model(model_dir, adapters["a"])(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_slots_and_host_cache_evict_least_recently_used(llama):
    model_dir, adapters = llama
    _, manager = _manager(model_dir, max_loras=1, max_cpu_loras=2)
    reqs = {i: _request(n, i, adapters[n]) for i, n in enumerate(["a", "b", "c"], start=1)}
    assert manager.add(reqs[1]) and manager.add(reqs[2])
    assert manager.add(reqs[2]) is False  # already loaded
    assert manager.pin(1)
    manager.add(reqs[3])  # the cache is full: the unpinned 2 goes
    assert manager.list() == {1, 3}
    manager.prepare(np.array([3, 0]), reqs, np.array([2, 1]))
    assert manager.slot_owner == [3]
    manager.prepare(np.array([2]), reqs, np.array([1]))  # read again from its path
    assert manager.slot_owner == [2] and manager.list() == {1, 2}
    assert manager.remove(2) and manager.slot_owner == [None]
    assert manager.remove(2) is False
    with pytest.raises(RuntimeError, match="--max-loras"):
        manager.prepare(np.array([1, 3]), reqs, np.array([1, 1]))


def test_a_step_computes_only_the_slots_up_to_the_highest_in_use(llama):
    model_dir, adapters = llama
    _, manager = _manager(model_dir)  # two slots of rank 16
    manager.prepare(np.array([0, 0]), {}, np.array([3, 1]))
    assert manager.step.rows is None  # no adapter: the base path
    reqs = {1: _request("a", 1, adapters["a"]), 2: _request("b", 2, adapters["b"])}
    manager.prepare(np.array([1, 0]), reqs, np.array([3, 1]))
    assert manager.step.mask.shape == (4, 1, 16)
    manager.prepare(np.array([2, 2]), reqs, np.array([1, 2]))  # one adapter: its block alone
    assert manager.step.rows == slice(16, 32) and manager.step.mask is None
    manager.prepare(np.array([2, 1]), reqs, np.array([1, 2]))
    assert manager.step.mask.shape == (3, 1, 32)
    assert np.array(manager.step.mask)[:, 0].tolist() == [
        [0.0] * 16 + [1.0] * 16,  # adapter b took the second slot
        [1.0] * 16 + [0.0] * 16,
        [1.0] * 16 + [0.0] * 16,
    ]


def test_target_modules_restrict_the_wrapped_projections(llama):
    model_dir, adapters = llama
    _, manager = _manager(model_dir, target_modules=["q_proj", "v_proj"])
    assert {path.split(".")[-1] for path in manager.layers} == {"q_proj", "v_proj"}
    # An adapter touching other projections does not fit.
    with pytest.raises(AdapterError, match="is not a linear projection"):
        manager.add(_request("a", 1, adapters["a"]))


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"r": 32}, "rank 32 is greater than max_lora_rank 16"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "'lm_head'"),
        ({"r": 4}, "rank 4"),  # the tensors say 8: another adapter's config
    ],
)
def test_adapters_this_model_cannot_serve_are_refused(llama, tmp_path, changes, match):
    model_dir, adapters = llama
    _, manager = _manager(model_dir)
    path = _edit_config(adapters["a"], tmp_path / "edited", **changes)
    with pytest.raises(AdapterError, match=match) as info:
        read_adapter(_request("edited", 9, path), manager.config, manager.shapes)
    assert "'edited'" in str(info.value)


def test_a_missing_adapter_is_not_found(llama, tmp_path):
    model_dir, _ = llama
    _, manager = _manager(model_dir)
    with pytest.raises(LoRAAdapterNotFoundError):
        manager.add(_request("gone", 9, tmp_path / "nothing-here"))
    assert manager.list() == set()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_projections_match_mlx_lm_lora_layers(
    tiny_quantized_dir, tiny_model_dir, tmp_path, bits
):
    from mlx_lm import load

    quantized = tiny_quantized_dir("qwen3", bits=bits, group_size=64)
    adapter = write_tiny_adapter(tiny_model_dir("qwen3"), tmp_path / "ad", rank=RANK, seed=7)
    model, manager = _manager(quantized)
    assert all(isinstance(layer.base, nn.QuantizedLinear) for layer in manager.layers.values())
    manager.add(_request("q", 1, adapter))
    tokens = [3, 50, 700, 12]
    manager.prepare(np.array([1]), {1: _request("q", 1, adapter)}, np.array([len(tokens)]))
    got = np.array(model(mx.array([tokens])).astype(mx.float32))

    reference, _ = load(str(quantized))
    apply_peft_with_mlx_lm(reference, adapter)
    want = np.array(reference(mx.array([tokens])).astype(mx.float32))
    # bfloat16 logits of magnitude ~16: one ulp is 0.125; the adapter moves them by far more.
    np.testing.assert_allclose(got, want, atol=0.125, rtol=0)
    manager.clear_step()
    base = np.array(model(mx.array([tokens])).astype(mx.float32))
    assert np.abs(base - want).max() > 1.0
