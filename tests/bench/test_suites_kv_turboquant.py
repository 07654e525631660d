"""Proves the TurboQuant KV suite (`python -m bench.run kv_turboquant --quick`) runs its engines and
op timings end to end and writes its report; full tier (three engines of the 8-layer checkpoint)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.full
def test_kv_turboquant_quick(run_suite) -> None:
    from vllm_metal.kv.turboquant import format_for

    run = run_suite("kv_turboquant")
    data = run.results()
    engines, model = data["engines"], data["model"]
    assert set(engines) == {"auto", "turboquant_k8v4", "turboquant_3bit_nc"}
    # Four of the eight layers keep the float32 cache (vLLM's boundary layers); the other four
    # hold one slot per token and head: the budget holds that many more tokens, to a few blocks.
    row = 2 * model["num_kv_heads"] * model["head_dim"] * 4  # bytes per token of a float32 layer
    for name in ("turboquant_k8v4", "turboquant_3bit_nc"):
        slot = format_for(name, model["head_dim"]).slot_bytes * model["num_kv_heads"]
        want = engines["auto"]["kv_cache_tokens"] * 8 * row / (4 * row + 4 * slot)
        assert abs(engines[name]["kv_cache_tokens"] - want) < 0.02 * want, (name, want)
    for engine in engines.values():
        assert engine["platform"] == "MetalPlatform" and engine["decode_tok_s"] > 0
        assert engine["log_lines_mentioning_preemption"] == 0
    ops = data["ops"]
    for name in ("turboquant_k8v4", "turboquant_3bit_nc"):
        assert ops["pool_bytes"][name] < ops["pool_bytes"]["auto"]
    assert all(v > 0 for k in ("attention_ms", "cache_write_ms") for v in ops[k].values())
    run.report("kv_turboquant", headings=("tokens held in the budget", "The machine is shared"))
