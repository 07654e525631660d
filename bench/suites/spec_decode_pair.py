"""One case as a *pair*: plain decoding and the case's speculation, two engines in one process whose
rounds alternate (plain first in even rounds, speculation first in odd ones), each round the
same prompts for both. On a machine whose speed drifts between runs by more than speculation
moves it (the GPU proxy: two runs of one plain engine differ by up to a quarter there), engines
in separate processes compare runs; a pair compares rounds a few seconds apart. Round 0 is a
warm-up (first shapes, the back-off's first measurements) and is not counted; each counted
round gives a speedup, plain TPOT over speculative TPOT (medians over the round's requests), and
the pair reports their median and range."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.harness.single_stream import make_prompts
from bench.suites.spec_decode import (
    _spec_counters,
    engine_args,
    run_round,
    spec_figures,
    warm_up,
)

MODES = ("plain", "spec")


def run_pair(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    n = max(1, case["concurrency"])
    started = time.perf_counter()
    engines = {mode: LLM(**engine_args(case, args, spec=mode == "spec")) for mode in MODES}
    engine_start_s = time.perf_counter() - started
    rounds = args.num_prompts + 1
    prompts = make_prompts(rounds * n + 1, args.input_len, args.seed)
    for llm in engines.values():
        warm_up(llm, prompts[0], args.output_len)
    before = _spec_counters(engines["spec"])
    tpot: dict[str, list[float]] = {mode: [] for mode in MODES}
    rate: dict[str, list[float]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        batch = prompts[1 + r * n : 1 + (r + 1) * n]
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            tpots, tok_s = run_round(engines[mode], case, args, batch, r * n)
            if r:
                tpot[mode].append(statistics.median(tpots))
                rate[mode].append(tok_s)
    speedups = [p / s for p, s in zip(tpot["plain"], tpot["spec"])]
    return {
        **case,
        "engine_start_s": round(engine_start_s, 1),
        "plain_tpot_ms": tpot["plain"],
        "spec_tpot_ms": tpot["spec"],
        "plain_tok_s": rate["plain"],
        "spec_tok_s": rate["spec"],
        "round_speedups": [round(x, 3) for x in speedups],
        "median_speedup": round(statistics.median(speedups), 3),
        "median_tpot_ms": statistics.median(tpot["spec"]),
        "output_tok_s": statistics.median(rate["spec"]),
        **spec_figures(engines["spec"], before),
    }
