"""LoRA adapters end to end on the MLX runner: mixed batches of base and adapter rows against
transformers float32 with each adapter merged by PEFT, slot and host-cache eviction, runtime
add/remove, bad adapters, and a quantized base against mlx-lm's own LoRA layers.

Each engine starts once per module and runs every job its tests look at.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx.runner.jobs import greedy, random_prompts, run_engine_job, tokens
from tests.fixtures.oracles import hf_greedy, mlx_lm_greedy
from tests.fixtures.tiny_lora import write_tiny_adapter
from vllm_metal.testing.tiny_models import quantize_tiny_model, write_tiny_model
from vllm_metal.testing.tiny_tokenizer import TOKENIZER_VOCAB_SIZE

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# Lengths below, at and above the prefill chunk (16 tokens), submitted together.
PROMPTS = random_prompts(21, [5, 23, 40, 12, 30, 9])
ROW_ADAPTERS = [None, "a", "b", "a", None, "b"]
# Three adapters for two slots and a host cache of two: rows wait for a slot, adapters are
# evicted from the cache and read again.
EVICT_PROMPTS = random_prompts(22, [7, 19, 11, 26, 8])
EVICT_ADAPTERS = ["c", "a", "b", "c", None]

ENGINE = {
    "max_num_batched_tokens": 16,  # chunked prefill next to decodes
    "enable_prefix_caching": True,
    "enable_lora": True,
    "max_loras": 2,
    "max_cpu_loras": 2,
    "max_lora_rank": 16,
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-llama")
    model = write_tiny_model(root / "model", "llama")
    # Another family with other shapes: its adapter does not fit this model.
    other = write_tiny_model(root / "other", "qwen3", hidden_size=128, num_heads=2, num_kv_heads=1)
    adapters = {
        "a": write_tiny_adapter(model, root / "a", rank=8, alpha=16, seed=1),
        # rsLoRA, attention only, a per-module rank
        "b": write_tiny_adapter(
            model,
            root / "b",
            rank=16,
            alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            rank_pattern={"o_proj": 4},
            seed=2,
        ),
        "c": write_tiny_adapter(
            model, root / "c", rank=4, alpha=4, target_modules=["gate_proj", "down_proj"], seed=3
        ),
        "too_big": write_tiny_adapter(model, root / "too_big", rank=32, seed=4),
        "head": write_tiny_adapter(model, root / "head", target_modules=["lm_head"], seed=5),
        "other": write_tiny_adapter(other, root / "other_adapter", seed=6),
    }
    return model, adapters


def _entry(adapters, name):
    ids = {"a": 1, "b": 2, "c": 3, "too_big": 4, "head": 5, "other": 6, "missing": 7}
    path = str(adapters[name]) if name in adapters else "/nonexistent/adapter"
    return None if name is None else [name, ids[name], path]


def _job(adapters, prompts, names):
    return {
        "prompts": prompts,
        "params": [greedy(NEW_TOKENS)],
        "loras": [_entry(adapters, n) for n in names],
    }


def _oracle(model, adapters, prompts, names):
    return [
        hf_greedy(model, [p], NEW_TOKENS, adapter=None if n is None else adapters[n])[0]
        for p, n in zip(prompts, names)
    ]


MIXED, CACHED, OTHER_ADAPTER, EVICT, REMOVE, AFTER_REMOVE = range(6)
BAD = ["too_big", "head", "other", "missing"]
BAD_JOBS = range(AFTER_REMOVE + 1, AFTER_REMOVE + 1 + len(BAD))
STILL_SERVING = BAD_JOBS[-1] + 1
SLEEP, AFTER_SLEEP = STILL_SERVING + 1, STILL_SERVING + 2
# The first long prompt (adapter "b" in MIXED) under adapter "a" and under the base model.
SWAPPED = [PROMPTS[2], PROMPTS[2]]
SWAPPED_ADAPTERS = ["a", None]


@pytest.fixture(scope="module")
def llama_run(llama):
    model, adapters = llama
    jobs = [
        _job(adapters, PROMPTS, ROW_ADAPTERS),
        _job(adapters, PROMPTS, ROW_ADAPTERS),  # again: served from cached blocks
        _job(adapters, SWAPPED, SWAPPED_ADAPTERS),
        _job(adapters, EVICT_PROMPTS, EVICT_ADAPTERS),
        {"action": "remove_lora", "lora": _entry(adapters, "c")},
        _job(adapters, EVICT_PROMPTS[:1], ["c"]),  # read again from its path
        *({"action": "add_lora", "lora": _entry(adapters, name)} for name in BAD),
        _job(adapters, PROMPTS[:2], ["a", None]),
        {"action": "sleep_wake"},
        _job(adapters, PROMPTS[:3], ["b", "a", None]),
    ]
    return run_engine_job(model, jobs, engine={**ENGINE, "enable_sleep_mode": True})


def test_mixed_batch_rows_match_peft_merged_models(llama, llama_run):
    model, adapters = llama
    assert tokens(llama_run[MIXED]) == _oracle(model, adapters, PROMPTS, ROW_ADAPTERS)


def test_prefix_cache_reuses_blocks_only_within_one_adapter(llama, llama_run):
    model, adapters = llama
    assert tokens(llama_run[CACHED]) == tokens(llama_run[MIXED])
    long_rows = [i for i, p in enumerate(PROMPTS) if len(p) >= 16]
    assert all(llama_run[CACHED][i]["num_cached_tokens"] >= 16 for i in long_rows)
    # The same tokens under another adapter (or none) share no blocks with adapter b's.
    swapped = llama_run[OTHER_ADAPTER]
    assert [r["num_cached_tokens"] for r in swapped] == [0, 0]
    assert tokens(swapped) == _oracle(model, adapters, SWAPPED, SWAPPED_ADAPTERS)


def test_more_adapters_than_slots_and_cache(llama, llama_run):
    model, adapters = llama
    assert tokens(llama_run[EVICT]) == _oracle(model, adapters, EVICT_PROMPTS, EVICT_ADAPTERS)


def test_removed_adapter_is_freed_and_read_again_on_demand(llama, llama_run):
    model, adapters = llama
    removed = llama_run[REMOVE]
    assert removed["result"] is True
    assert 3 not in removed["loras"]
    assert tokens(llama_run[AFTER_REMOVE]) == _oracle(model, adapters, EVICT_PROMPTS[:1], ["c"])


@pytest.mark.parametrize(
    "name, words",
    [
        ("too_big", ["rank", "32", "16"]),
        ("head", ["'head'", "lm_head"]),
        ("other", ["'other'", "another"]),
        ("missing", ["no adapter found", "/nonexistent/adapter"]),
    ],
)
def test_bad_adapters_are_refused_with_the_cause(llama_run, name, words):
    outcome = llama_run[BAD_JOBS[BAD.index(name)]]
    assert "error" in outcome, outcome
    assert all(w.lower() in outcome["error"].lower() for w in words), outcome["error"]
    assert 4 + BAD.index(name) not in outcome["loras"]


def test_engine_keeps_serving_after_bad_adapters(llama, llama_run):
    model, adapters = llama
    assert tokens(llama_run[STILL_SERVING]) == _oracle(model, adapters, PROMPTS[:2], ["a", None])


def test_adapters_survive_sleep_and_wake_up(llama, llama_run):
    """Level 2 reloads the model: its projections are wrapped again, the cached adapters refill
    the new slots."""
    model, adapters = llama
    # The host cache (two adapters, the last used "a" among them) outlives the model.
    loras = llama_run[SLEEP]["loras"]
    assert len(loras) == 2 and 1 in loras
    expected = _oracle(model, adapters, PROMPTS[:3], ["b", "a", None])
    assert tokens(llama_run[AFTER_SLEEP]) == expected


def test_ngram_speculation_verifies_adapter_rows(llama):
    """Verification rows carry their request's adapter: drafts are judged by the adapted model."""
    model, adapters = llama
    # The first two prompts hold every ordinary token (16 on) once: whatever a random model emits,
    # the n-gram proposer finds it in the context and drafts what followed it there.
    rng = np.random.default_rng(7)
    every = [rng.permutation(np.arange(16, TOKENIZER_VOCAB_SIZE)).tolist() for _ in range(2)]
    prompts = [*every, *PROMPTS[:2]]
    names = ["a", "b", None, "a"]
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    out, metrics = run_engine_job(
        model,
        [_job(adapters, prompts, names)],
        # vLLM asks max_num_batched_tokens >= max_num_seqs * (1 + K) with LoRA and drafts.
        engine={
            **ENGINE,
            "max_num_batched_tokens": 32,
            "max_num_seqs": 8,
            "max_model_len": 1024,  # the 752-token prompts
            "speculative_config": spec,
            "disable_log_stats": False,
        },
        with_metrics=True,
        env={"VLLM_METAL_SPEC_BACKOFF": "0"},  # draft whenever the n-gram proposer finds one
    )
    assert tokens(out[0]) == _oracle(model, adapters, prompts, names)
    assert metrics["vllm:spec_decode_num_draft_tokens"] > 0


# ---------------------------------------------------------------- a second family, quantized


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-qwen3")
    model = write_tiny_model(root / "model", "qwen3")
    quantized = quantize_tiny_model(model, root / "q8", bits=8, group_size=64)
    adapters = {
        "a": write_tiny_adapter(model, root / "a", rank=16, alpha=32, seed=11),
        "b": write_tiny_adapter(
            model, root / "b", rank=8, alpha=8, target_modules=["v_proj", "up_proj"], seed=12
        ),
    }
    return model, quantized, adapters


@pytest.mark.full
def test_second_family_mixed_batch(qwen3):
    model, _, adapters = qwen3
    out = run_engine_job(model, [_job(adapters, PROMPTS, ROW_ADAPTERS)], engine=ENGINE)
    assert tokens(out[0]) == _oracle(model, adapters, PROMPTS, ROW_ADAPTERS)


def test_quantized_base_matches_mlx_lm_lora_layers(qwen3):
    _, quantized, adapters = qwen3
    names = ["a", None, "b"]
    prompts = PROMPTS[:3]
    out = run_engine_job(quantized, [_job(adapters, prompts, names)], engine=ENGINE)
    expected = [
        mlx_lm_greedy(
            quantized,
            [p],
            NEW_TOKENS,
            dtype="float32",
            adapter=None if n is None else adapters[n],
        )[0]
        for p, n in zip(prompts, names)
    ]
    assert tokens(out[0]) == expected
