"""Speculative decoding: TPOT and throughput with and without `--speculative-config`, one run.

Every case is one `vllm.LLM` in a fresh process, on the benchmark checkpoint (`bench/harness/checkpoints.py`),
with the same prompts and output length:

- single stream, greedy (the *repetitive* workload: the random model's greedy continuation falls
  into a short cycle within a few tokens, so, as in a code edit, most of what comes next is
  already in the context), plain / n-gram / draft model;
- single stream, sampled at temperature 1 (the *non-repetitive* workload: the random model's
  distribution is close to uniform, so drafts are almost never right), plain / n-gram / draft
  model, and the two speculative ones again with the back-off off (what it saves);
- 8 and 32 concurrent requests, greedy, plain / n-gram;
- single stream, greedy, plain / EAGLE-3 (with the back-off and without) on a *self-drafting*
  target: the benchmark checkpoint
  with every attention output and MLP down projection zero (the same cost per step), whose next
  token depends on the current one alone, and an EAGLE-3 head that computes that function
  (`tests.fixtures.tiny_eagle3`), so nearly all of its drafts are accepted.

The target is the benchmark checkpoint made *draftable* (`bench.harness.checkpoints.write_draftable`): the
layers between the second and the last add nothing and the last adds a scaled-down part, so its
first two layers (the draft: those layers with the embeddings, norm and head) predict most of its
tokens, as a trained draft would; the target still runs every layer at full size, so its decode
cost is the benchmark checkpoint's. Each case records the median TPOT, output tok/s and vLLM's
spec-decode counters. Ratios are taken between cases of the same run.

    python -m bench.run spec_decode --out docs/benchmarks            # ~15 min on 2 cores
    python -m bench.run spec_decode --quick --out /tmp/spec-quick    # tiny model, checks the harness

`--profile` runs each engine core in its case's process and adds where its steps go: mean ms a step
in each phase (`bench.harness.phases.PhaseTimers`: graph build, host work, submit, waits, sampling,
drafting, the engine around them), each step kind's and each kind of a head's proposal's
count with median and longest ms (`StepKinds`, `DraftCalls`), and a cProfile of one more round.

`--quick`: the tiny model, 8 output tokens, one round, and the n-gram case of the repetitive
workload alone (its speedups over plain decoding are then not measured); `--quick --peers` adds the
plain and draft-model cases of that workload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.checkpoints import write_draftable, write_layer_subset, write_model
from bench.harness.phases import PhaseTimers, profiled
from bench.harness.single_stream import make_prompts
from bench.harness.stages import (
    add_case_choice,
    pick_cases,
    python_stage,
    runs_peers,
    suite_parser,
)
from bench.suites.spec_decode_report import summarize, write_report

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
DRAFT_TOKENS = 3
DRAFT_LAYERS = 2
# Scale of the draftable target's last layer: its 2-layer draft then agrees on ~70% of greedy
# tokens (0.2 gives ~80%, 0.5 ~30%, measured with mlx-lm on the 0.6B checkpoint).
LAST_LAYER_SCALE = 0.3
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 0}


# `--quick --peers` runs one case of each kind (each case is an engine start of its own),
# `--quick` the n-gram one.
QUICK_CASES = (
    "plain_repetitive",
    "ngram_repetitive",
    "draft_repetitive",
    "plain_self_drafting",
    "eagle3_self_drafting",
)


def cases(draft: str, eagle3_head: str, concurrency: list[int]) -> list[dict[str, Any]]:
    draft_cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": DRAFT_TOKENS}
    eagle3_cfg = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": DRAFT_TOKENS}
    out = []
    for workload, params in (("repetitive", GREEDY), ("non_repetitive", SAMPLED)):
        out += [
            {"name": f"plain_{workload}", "spec": None, "params": params, "concurrency": 1},
            {"name": f"ngram_{workload}", "spec": NGRAM, "params": params, "concurrency": 1},
            {"name": f"draft_{workload}", "spec": draft_cfg, "params": params, "concurrency": 1},
        ]
    out += [
        # n-gram speculation runs with async scheduling off: what that alone costs.
        {"name": "plain_non_repetitive_sync", "spec": None, "params": SAMPLED, "concurrency": 1,
         "engine": {"async_scheduling": False}},
        {"name": "ngram_non_repetitive_no_backoff", "spec": NGRAM, "params": SAMPLED,
         "concurrency": 1, "backoff": False},
        {"name": "draft_non_repetitive_no_backoff", "spec": draft_cfg, "params": SAMPLED,
         "concurrency": 1, "backoff": False},
    ]  # fmt: skip
    for n in concurrency:
        out += [
            {"name": f"plain_c{n}", "spec": None, "params": GREEDY, "concurrency": n},
            {"name": f"ngram_c{n}", "spec": NGRAM, "params": GREEDY, "concurrency": n},
        ]
    out += [
        {"name": "plain_self_drafting", "spec": None, "params": GREEDY, "concurrency": 1,
         "target": "self_drafting"},
        {"name": "eagle3_self_drafting", "spec": eagle3_cfg, "params": GREEDY, "concurrency": 1,
         "target": "self_drafting"},
        # Every step drafts: verification with accepted drafts where the back-off would find
        # plain steps faster (the GPU proxy).
        {"name": "eagle3_self_drafting_no_backoff", "spec": eagle3_cfg, "params": GREEDY,
         "concurrency": 1, "target": "self_drafting", "backoff": False},
    ]  # fmt: skip
    return out


# ------------------------------------------------------------------ one case (in its own process)


def _spec_counters(llm: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            value = getattr(metric, "value", None)
            found[metric.name.removeprefix("vllm:spec_decode_")] = (
                value if value is not None else getattr(metric, "values", None)
            )
    return found


def engine_args(
    case: dict[str, Any], args: argparse.Namespace, spec: bool = True
) -> dict[str, Any]:
    """`vllm.LLM`'s arguments for `case` (without its speculative config where `spec` is off)."""
    engine: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.input_len + args.output_len + 16,
        "max_num_seqs": max(1, case["concurrency"]),
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "seed": 0,
        "disable_log_stats": False,
    }
    if spec and case["spec"] is not None:
        engine["speculative_config"] = case["spec"]
    engine.update(case.get("engine", {}))
    return engine


def run_round(llm: Any, case: dict[str, Any], args: argparse.Namespace, prompts: list,
              first: int) -> tuple[list[float], float]:  # fmt: skip
    """One round: `prompts` at once, request i sampled with the case's parameters (a seed there
    is offset by `first + i`). Each request's TPOT in ms, and output tok/s."""
    from vllm import SamplingParams

    def params(i: int) -> Any:
        p = dict(case["params"])
        if "seed" in p:
            p["seed"] += i
        return SamplingParams(max_tokens=args.output_len, ignore_eos=True, **p)

    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [params(first + i) for i in range(len(prompts))],
        use_tqdm=False,
    )
    wall = time.perf_counter() - start
    tpots = []
    for o in outs:
        m, k = o.metrics, len(o.outputs[0].token_ids)
        tpots.append((m.last_token_ts - m.first_token_ts) / max(1, k - 1) * 1e3)
    return tpots, sum(len(o.outputs[0].token_ids) for o in outs) / wall


def warm_up(llm: Any, prompt: list[int], max_tokens: int) -> None:
    """One greedy request as long as the measured ones: every shape their steps take (block
    tables grow with the context; compiled steps trace once per shape bucket) is met before
    the clock runs."""
    from vllm import SamplingParams

    warm = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": prompt}], warm, use_tqdm=False)


def spec_figures(llm: Any, before: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters since `before` (`_spec_counters`), with the acceptance rate
    and mean acceptance length they give."""
    after = _spec_counters(llm)
    counters = {
        k: (
            [a - b for a, b in zip(v, before.get(k) or [0] * len(v))]
            if isinstance(v, list)
            else v - (before.get(k) or 0)
        )
        for k, v in after.items()
    }
    drafts, drafted = counters.get("num_drafts", 0), counters.get("num_draft_tokens", 0)
    accepted = counters.get("num_accepted_tokens", 0)
    return {
        "spec_counters": counters,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def run_case(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    timers = None
    if args.profile:  # the engine core in this process, its steps timed by phase
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        timers = PhaseTimers()
        timers.install()
    from vllm import LLM

    n = case["concurrency"]
    started = time.perf_counter()
    llm = LLM(**engine_args(case, args))
    engine_start_s = time.perf_counter() - started
    prompts = make_prompts(args.num_prompts * max(1, n) + 1, args.input_len, args.seed)
    warm_up(llm, prompts[0], args.output_len)
    before = _spec_counters(llm)
    if timers is not None:
        timers.reset()
    tpots, rates = [], []
    for r in range(args.num_prompts):
        round_tpots, rate = run_round(llm, case, args, prompts[1 + r * n : 1 + (r + 1) * n], r * n)
        tpots += round_tpots
        rates.append(rate)
    result = {
        **case,
        "engine_start_s": round(engine_start_s, 1),
        "median_tpot_ms": statistics.median(tpots),
        "output_tok_s": statistics.median(rates),
        **spec_figures(llm, before),
    }
    if timers is not None:  # then one more round of the first prompts, under cProfile
        result["phases"] = timers.summary()
        result["backoff_rates"] = backoff_rates(llm)
        result["profile"] = profiled(lambda: run_round(llm, case, args, prompts[1 : 1 + n], 0))
    return result


def backoff_rates(llm: Any) -> dict[str, dict[str, Any]]:
    """In-process: what the back-off measured, per batch bucket (`backoff.batch_bucket`): the
    token rate of decode steps that verified drafts and of those that did not, with their
    samples, and which it took for the faster when it last decided."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    if runner.spec is None:
        return {}
    return {
        str(b): {
            "spec_tok_s": round(k.spec.tokens_per_s, 1),
            "spec_samples": k.spec.samples,
            "plain_tok_s": round(k.plain.tokens_per_s, 1),
            "plain_samples": k.plain.samples,
            "faster_is_spec": k.faster_is_spec,
        }
        for b, k in sorted(runner.spec.backoff.buckets.items())
    }


# ------------------------------------------------------------------------------- the whole run


def _self_drafting_pair(source: Path, work: Path) -> tuple[Path, Path]:
    """(or reuse) the self-drafting target of `source` and its EAGLE-3 head."""
    from tests.fixtures.tiny_eagle3 import self_drafting_target, write_eagle3_head

    target = work / f"{source.name}-self-drafting"
    head = work / f"{source.name}-eagle3-head"
    if not (head / "config.json").is_file():
        self_drafting_target(source, target)
        write_eagle3_head(target, head, self_drafting=True)
    return target, head


def run_cases(
    suite: str,
    chosen: list[dict[str, Any]],
    argv_of: Callable[[dict[str, Any]], list[str]],
    timeout: float,
    logs: Path,
) -> dict[str, dict[str, Any]]:
    """Each case in a fresh process (`run_case`, with `argv_of(case)` for its model and sizes),
    the back-off on unless the case says `backoff: False`; each case's figures are printed as
    it ends, so a run cut short still leaves them in its output."""
    results: dict[str, dict[str, Any]] = {}
    for case in chosen:
        print(f"[{suite}] {case['name']}", flush=True)
        backoff = case.pop("backoff", True)
        os.environ["VLLM_METAL_SPEC_BACKOFF"] = "1" if backoff else "0"
        argv = [*argv_of(case), "--case", json.dumps(case)]
        done = python_stage("bench.suites.spec_decode", argv, timeout, logs / f"{case['name']}.log")
        done["backoff"] = backoff
        results[case["name"]] = done
        print(
            f"[{suite}] {case['name']}: TPOT {done['median_tpot_ms']:.2f} ms, "
            f"{done['output_tok_s']:.2f} tok/s, acceptance {done.get('acceptance_rate')}",
            flush=True,
        )
    os.environ.pop("VLLM_METAL_SPEC_BACKOFF", None)
    return results


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("spec_decode", __doc__, "tiny model: checks the harness")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--num-prompts", type=int, default=None, help="rounds per case: 2 (1 quick)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--seed", type=int, default=0)
    add_case_choice(p)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="engines in-process: each step's phases (bench.harness.phases), and a cProfile of "
        "one more round of each case",
    )
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in-process
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = 8 if args.quick else 64
    if args.num_prompts is None:
        args.num_prompts = 1 if args.quick and not runs_peers(args) else 2

    if args.case is not None:  # a child process: run one case (or one pair, `spec_decode_pair`)
        from bench.suites.spec_decode_pair import run_pair

        case = json.loads(args.case)
        result = run_pair(case, args) if case.get("pair") else run_case(case, args)
        Path(args.json).write_text(json.dumps(result, indent=2))
        return 0

    work = Path(args.work_dir) / "models"
    source = write_model(work, "tiny" if args.quick else "0.6b", args.dtype)
    model = write_draftable(source, work / f"{source.name}-draftable", DRAFT_LAYERS,
                            LAST_LAYER_SCALE)  # fmt: skip
    draft = write_layer_subset(model, work / f"{model.name}-first{DRAFT_LAYERS}", DRAFT_LAYERS)
    self_target, eagle3_head = _self_drafting_pair(source, work)
    logs = Path(args.work_dir) / "spec_decode"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    common = [
        "--model", str(model), "--dtype", args.dtype, "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--seed", str(args.seed), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
        *(["--profile"] if args.profile else []),
    ]  # fmt: skip
    chosen = cases(str(draft), str(eagle3_head), args.concurrency)
    if args.quick and not args.cases:  # one engine of each kind, or n-gram alone
        quick = QUICK_CASES if runs_peers(args) else ("ngram_repetitive",)
        chosen = [c for c in chosen if c["name"] in quick]
    chosen = pick_cases(p, args, chosen)
    targets = {"self_drafting": str(self_target)}

    def argv_of(case: dict[str, Any]) -> list[str]:
        target = targets.get(case.get("target", ""))
        return common if target is None else [*common, "--model", target]

    results = run_cases("spec_decode", chosen, argv_of, args.timeout, logs)
    report = {
        "settings": {
            "model": str(model),
            "draft": str(draft),
            "eagle3_head": str(eagle3_head),
            "dtype": args.dtype,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
            "ngram": NGRAM,
            "draft_tokens": DRAFT_TOKENS,
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "cases": results,
        "summary": summarize(results),
    }
    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
