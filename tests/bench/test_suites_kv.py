"""Proves the quantized KV-cache suites (`python -m bench.run kv_fp8|kv_ptk|kv_turboquant --quick`)
run their engines and op timings end to end and write their reports; all in the full tier (two to
four engines each: CI's budget; the quantized caches' engines have their own CI tests)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
@pytest.mark.full
def test_kv_fp8_quick(run_suite) -> None:
    run = run_suite("kv_fp8")
    data = run.results()
    auto, fp8 = data["engines"]["auto"], data["engines"]["fp8"]
    assert auto["platform"] == fp8["platform"] == "MetalPlatform"
    # Same budget, one byte per element instead of four (the float32 checkpoint's): four times
    # the tokens, to a few blocks (each pool count is rounded down to whole blocks).
    from bench.suites.kv_fp8_report import element_bytes

    n = element_bytes(data["model"])
    assert n == 4 and 0 <= fp8["kv_cache_tokens"] - n * auto["kv_cache_tokens"] < n * 128

    for engine in (auto, fp8):
        assert engine["decode_tok_s"] > 0 and engine["log_lines_mentioning_preemption"] == 0
        assert all(n == data["settings"]["output_len"] for r in engine["tokens"] for n in r)
    ops = data["ops"]
    assert ops["backend"] == "native"
    assert ops["pool_bytes"]["auto"] == n * ops["pool_bytes"]["fp8"]
    assert all(ops[k][c] > 0 for k in ("attention_ms", "cache_write_ms") for c in ("auto", "fp8"))
    run.report("kv_fp8", headings=("tokens held in the budget", "The machine is shared"))


@pytest.mark.slow
@pytest.mark.full
def test_kv_ptk_quick(run_suite) -> None:
    run = run_suite("kv_ptk")
    data = run.results()
    engines, ops = data["engines"], data["ops"]
    auto = engines["auto"]
    m = data["model"]
    d = m["head_dim"]
    row = 4 * d  # the float32 checkpoint's unquantized row
    for cache, stored in (("int8_per_token_head", d + 4), ("fp8_per_token_head", d + 4),
                          ("int4_per_token_head", d // 2 + 4)):  # fmt: skip
        # Same budget, rows of data and a float32 scale: that many more tokens, to whole blocks.
        want = auto["kv_cache_tokens"] * row / stored
        assert abs(engines[cache]["kv_cache_tokens"] - want) < 2 * 16 * row / stored
        assert ops["pool_bytes"][cache] * row == ops["pool_bytes"]["auto"] * stored
    for engine in engines.values():
        assert engine["platform"] == "MetalPlatform" and engine["decode_tok_s"] > 0
        assert all(n == data["settings"]["output_len"] for r in engine["tokens"] for n in r)
    assert all(ops["attention_ms"][c] > 0 for c in engines)
    run.report("kv_ptk", headings=("tokens held in the budget", "The machine is shared"))


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
