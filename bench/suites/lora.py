"""LoRA on the MLX runner: the cost of one wrapped projection, and decode with adapters, one run.

1. **Op micro-benchmark** (one process, MLX only): a projection's LoRA update the way the runner
   computes it (`lora/layer.py`: every slot's rank block side by side, a per-token mask, two dense
   matmuls) against per-token adapter selection with `mx.gather_mm` (slot 0 of the stacked `A`
   and `B` is zero, for base-model tokens), and the base projection alone; float32, rank 16,
   T in {1, 8, 256} tokens, 1024 -> 1024 and 1024 -> 3072, 2 and 4 slots. Both methods are
   checked against a per-token numpy reference first. Median ms per call over samples that each
   evaluate several calls in one graph. (On MLX's CPU backend `gather_mm` is float32 only and
   runs one BLAS call per token.)
2. **Engine** (every case one `vllm.LLM` in a fresh process, benchmark checkpoint of
   `bench/harness/checkpoints.py`, two random rank-16 adapters on every attention and MLP projection, the same
   prompts and output length, greedy, EOS ignored): 8 concurrent requests with LoRA off, with
   `--enable-lora` and every request on the base model (the wrapping alone), and split 4/4
   across the adapters; one request with LoRA off and on one adapter. Median TPOT and output
   tok/s per case; ratios are taken between cases of this run.

    python -m bench.run lora --out docs/benchmarks            # expected ~10 min on 2 cores
    python -m bench.run lora --quick --out /tmp/lora-quick    # tiny model, checks the harness

`--quick`: the tiny model, one round of 8 tokens per case, and the op micro-benchmark on its
smallest shape (1024 -> 1024, 2 slots, 1 and 8 tokens); without `--peers` only the case with
adapters (8 requests split across both), since the others are there to compare with it (its ratios
and checks are then not measured). That one case is a process of ~20 s on 2 cores (vLLM's imports,
the engine start, the adapters' first steps): the quick run takes ~28 s, not less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.checkpoints import write_model
from bench.harness.single_stream import make_prompts
from bench.harness.stages import python_stage, runs_peers, suite_parser

RANK = 16
ALPHA = 16
ADAPTER_SEEDS = (1, 2)  # one adapter per seed; --max-loras is their number
ADAPTER_STD = 0.05  # deltas about half the size of the random projections' outputs
CONCURRENCY = 8
OP_TOKENS = (1, 8, 256)
OP_SHAPES = ((1024, 1024), (1024, 3072))
OP_SLOTS = (2, 4)
TARGETS = {"lora_step_time_vs_base": 1.3}  # TPOT, 8 requests split across adapters / LoRA off


def cases(n: int = CONCURRENCY) -> list[dict[str, Any]]:
    """`adapters[i]`: the adapter (index into the written ones) of request i, None for the base."""
    return [
        {"name": f"base_c{n}", "lora": False, "adapters": [None] * n},
        {"name": f"lora_on_base_c{n}", "lora": True, "adapters": [None] * n},
        {"name": f"lora_split_c{n}", "lora": True, "adapters": [i % 2 for i in range(n)]},
        {"name": "base_c1", "lora": False, "adapters": [None]},
        {"name": "lora_c1", "lora": True, "adapters": [0]},
    ]


# ------------------------------------------------------------------ op micro-benchmark


def _median_ms(fn: Any, warmup: int, repeats: int) -> float:
    import mlx.core as mx

    warm = []
    for _ in range(max(3, warmup)):
        start = time.perf_counter()
        mx.eval(fn())
        warm.append(time.perf_counter() - start)
    # A sample evaluates enough calls in one graph (as a step evaluates all its layers) to last
    # ~10 ms, so that short calls are neither timer noise nor one graph launch each.
    calls = min(200, max(1, int(0.01 / max(statistics.median(warm), 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(samples)


def op_case(tokens: int, shape: tuple[int, int], slots: int, warmup: int, repeats: int) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx import nn

    from vllm_metal.backends.mlx.runner.lora.layer import LoRALinear, StepMask

    fin, fout = shape
    mx.random.seed(tokens * 7 + slots)
    base = nn.Linear(fin, fout, bias=False)
    step = StepMask()
    layer = LoRALinear(base, shape, slots * RANK, mx.float32, step)
    a = mx.random.normal((slots, fin, RANK)) * ADAPTER_STD
    b = mx.random.normal((slots, RANK, fout)) * ADAPTER_STD
    for s in range(slots):
        layer.write(slice(s * RANK, (s + 1) * RANK), a[s], b[s])
    # Tokens cycle through the slots; every (slots + 1)-th token is a base-model token (-1).
    token_slot = np.array([t % (slots + 1) for t in range(tokens)], dtype=np.int32)
    token_slot[token_slot == slots] = -1
    block = np.arange(slots * RANK) // RANK
    step.rows = slice(0, slots * RANK)
    step.mask = mx.array((block[None, :] == token_slot[:, None]).astype(np.float32))[:, None, :]
    a0 = mx.concatenate([mx.zeros((1, fin, RANK)), a])  # slot 0: the base model's zero update
    b0 = mx.concatenate([mx.zeros((1, RANK, fout)), b])
    index = mx.array(token_slot + 1, dtype=mx.uint32)
    x = mx.random.normal((tokens, 1, fin))
    mx.eval(layer.parameters(), step.mask, a0, b0, index, x)

    def stacked() -> mx.array:  # the update of LoRALinear.__call__
        return layer.update(x, step.rows, step.mask)

    def gathered() -> mx.array:
        return mx.gather_mm(mx.gather_mm(x, a0, rhs_indices=index), b0, rhs_indices=index)

    xs, an, bn = np.array(x)[:, 0].astype(np.float64), np.array(a), np.array(b)
    want = np.stack([xs[t] @ an[s] @ bn[s] if s >= 0 else np.zeros(fout)
                     for t, s in enumerate(token_slot)])[:, None]  # fmt: skip
    got_s, got_g = np.array(stacked()), np.array(gathered())
    np.testing.assert_allclose(got_s, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_g, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got_s, got_g, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(layer(x)), np.array(base(x)) + got_s, rtol=1e-4, atol=1e-4)
    fns = {
        "base_ms": lambda: base(x),
        "stacked_update_ms": stacked,
        "gather_update_ms": gathered,
        "stacked_total_ms": lambda: layer(x),
        "gather_total_ms": lambda: base(x) + gathered(),
    }
    timed = {k: _median_ms(f, warmup, repeats) for k, f in fns.items()}
    return {"tokens": tokens, "in": fin, "out": fout, "slots": slots, "rank": RANK, **timed}


def run_ops(quick: bool) -> dict[str, Any]:
    from bench.harness.machine import describe_machine

    machine = describe_machine()  # imports the plugin first: MLX's matmuls on its CPU BLAS
    # --quick: the smallest shape only (it checks the harness; on a busy machine every BLAS call
    # can wait a scheduler time slice, and gather_mm makes one call per token).
    if quick:
        shapes, slots, tokens = OP_SHAPES[:1], OP_SLOTS[:1], OP_TOKENS[:2]
    else:
        shapes, slots, tokens = OP_SHAPES, OP_SLOTS, OP_TOKENS
    warmup, repeats = (3, 5) if quick else (3, 25)
    out = [op_case(t, shape, s, warmup, repeats)
           for shape in shapes for s in slots for t in tokens]  # fmt: skip
    return {"machine": machine, "ops": out}


# ------------------------------------------------------------------ adapters and engine cases


def write_adapters(model: Path) -> list[str]:
    """Write (or reuse) the random adapters next to `model`."""
    from tests.fixtures.tiny_lora import write_tiny_adapter

    model_stamp = (model / "bench_model.json").read_text()
    paths = []
    for seed in ADAPTER_SEEDS:
        out = model.parent / f"{model.name}-lora-r{RANK}-s{seed}"
        stamp = {"rank": RANK, "alpha": ALPHA, "seed": seed, "std": ADAPTER_STD,
                 "model": model_stamp}  # fmt: skip
        stamp_file = out / "bench_adapter.json"
        if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
            write_tiny_adapter(model, out, rank=RANK, alpha=ALPHA, seed=seed, std=ADAPTER_STD)
            stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
        paths.append(str(out))
    return paths


def run_case(case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    n = len(case["adapters"])
    engine: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "max_model_len": args.input_len + args.output_len + 16,
        "max_num_seqs": n,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "seed": 0,
        "disable_log_stats": False,  # per-request metrics (TPOT)
    }
    if case["lora"]:
        engine.update(enable_lora=True, max_loras=len(args.adapters), max_lora_rank=RANK)
    started = time.perf_counter()
    llm = LLM(**engine)
    engine_start_s = time.perf_counter() - started

    def lora(i: int | None) -> Any:
        return None if i is None else LoRARequest(f"adapter{i}", i + 1, args.adapters[i])

    requests = [lora(i) for i in case["adapters"]]
    prompts = make_prompts(args.num_prompts * n + 1, args.input_len, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    # Warm-up: one short request per adapter of the case, so adapter reads are not timed.
    warm = [lora(i) for i in sorted(set(case["adapters"]), key=str)]
    llm.generate([{"prompt_token_ids": prompts[0]}] * len(warm),
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                 lora_request=warm, use_tqdm=False)  # fmt: skip

    tpots, rates, first_tokens = [], [], []
    for r in range(args.num_prompts):
        batch = prompts[1 + r * n : 1 + (r + 1) * n]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params,
                            lora_request=requests, use_tqdm=False)  # fmt: skip
        wall = time.perf_counter() - start
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == [args.output_len] * n, counts
        rates.append(sum(counts) / wall)
        for o in outs:
            m = o.metrics
            tpots.append((m.last_token_ts - m.first_token_ts) / max(1, args.output_len - 1) * 1e3)
        if r == 0:
            first_tokens = [list(o.outputs[0].token_ids[:8]) for o in outs]
    return {
        **case,
        "concurrency": n,
        "engine_start_s": round(engine_start_s, 1),
        "median_tpot_ms": statistics.median(tpots),
        "output_tok_s": statistics.median(rates),
        "first_tokens": first_tokens,  # round 0, first 8 tokens per request
    }


# ------------------------------------------------------------------------------- the whole run


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case over its passes: median TPOT and tok/s, each pass's figures kept."""
    out = dict(runs[0])
    for key in ("median_tpot_ms", "output_tok_s"):
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[f"{key}_passes"] = values
    return out


def summarize(results: dict[str, dict[str, Any]], ops: list[dict[str, Any]]) -> dict[str, Any]:
    def ratio(num: str, den: str, key: str) -> float | None:
        a, b = results.get(num, {}).get(key), results.get(den, {}).get(key)
        return round(a / b, 3) if a and b else None

    n = CONCURRENCY
    ratios = {
        "lora_step_time_vs_base": ratio(f"lora_split_c{n}", f"base_c{n}", "median_tpot_ms"),
        "lora_wrapping_step_time_vs_base": ratio(
            f"lora_on_base_c{n}", f"base_c{n}", "median_tpot_ms"
        ),
        "lora_throughput_vs_base": ratio(f"lora_split_c{n}", f"base_c{n}", "output_tok_s"),
        "single_stream_lora_step_time_vs_base": ratio("lora_c1", "base_c1", "median_tpot_ms"),
    }
    targets = {
        key: {"goal": goal, "measured": ratios.get(key),
              "met": ratios.get(key) is not None and ratios[key] <= goal}
        for key, goal in TARGETS.items()
    }  # fmt: skip
    base, split = results.get(f"base_c{n}", {}), results.get(f"lora_split_c{n}", {})
    wrapped = results.get(f"lora_on_base_c{n}", {})
    # Greedy tokens: the wrapping alone must not change them; the adapters should. None where a
    # case did not run (`--quick` without `--peers`).
    checks = {
        "wrapping_keeps_base_tokens": wrapped.get("first_tokens") == base.get("first_tokens")
        if base and wrapped else None,
        "adapters_change_tokens": split.get("first_tokens") != base.get("first_tokens")
        if base and split else None,
    }  # fmt: skip
    op_ratios = {
        f"T{o['tokens']}_{o['in']}x{o['out']}_s{o['slots']}": {
            "stacked_vs_gather": round(o["stacked_update_ms"] / o["gather_update_ms"], 3),
            "stacked_total_vs_base": round(o["stacked_total_ms"] / o["base_ms"], 3),
            "gather_total_vs_base": round(o["gather_total_ms"] / o["base_ms"], 3),
        }
        for o in ops
    }
    return {"ratios": ratios, "targets": targets, "checks": checks, "ops": op_ratios}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("lora", __doc__, "tiny model: checks the harness")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--num-prompts", type=int, default=None, help="rounds per case: 3 (1 quick)")
    p.add_argument("--passes", type=int, default=None, help="round-robin passes: 2 (1 quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child: one engine case
    p.add_argument("--ops", action="store_true", help=argparse.SUPPRESS)  # child: micro-bench
    p.add_argument("--write-adapters", action="store_true", help=argparse.SUPPRESS)  # child
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--adapters", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.output_len is None:
        args.output_len = 8 if args.quick else 64
    if args.num_prompts is None:
        args.num_prompts = 1 if args.quick else 3
    if args.passes is None:
        args.passes = 1 if args.quick else 2

    child = None
    if args.case is not None:
        child = run_case(json.loads(args.case), args)
    else:  # one process for both when both are asked for: one interpreter start fewer
        if args.ops:
            child = run_ops(args.quick)
        if args.write_adapters:
            child = {**(child or {}), "paths": write_adapters(Path(args.model))}
    if child is not None:
        Path(args.json).write_text(json.dumps(child, indent=2))
        return 0

    started = time.perf_counter()
    model = write_model(Path(args.work_dir) / "models", "tiny" if args.quick else "0.6b",
                        args.dtype)  # fmt: skip
    logs = Path(args.work_dir) / "lora"
    logs.mkdir(parents=True, exist_ok=True)

    def stage(name: str, argv: list[str]) -> dict[str, Any]:
        print(f"[lora] {name}", flush=True)
        return python_stage("bench.suites.lora", argv, args.timeout, logs / f"{name}.log")

    ops = stage("ops", ["--ops", "--write-adapters", "--model", str(model)]
                + (["--quick"] if args.quick else []))  # fmt: skip
    adapters = ops["paths"]
    common = [
        "--model", str(model), "--dtype", args.dtype, "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--seed", str(args.seed), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
        "--adapters", *adapters,
    ]  # fmt: skip
    # The cases run round-robin, `--passes` times: the machine's drift over the run then falls on
    # every case alike. Each case reports the median over its passes; the spread is kept.
    run = (
        cases() if runs_peers(args) else [c for c in cases() if c["name"].startswith("lora_split")]
    )
    passes: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in run}
    for k in range(args.passes):
        for c in run:
            name = c["name"] if args.passes == 1 else f"{c['name']}-pass{k + 1}"
            passes[c["name"]].append(stage(name, [*common, "--case", json.dumps(c)]))
    results = {name: _combine(runs) for name, runs in passes.items()}
    report = {
        "settings": {
            "model": str(model),
            "adapters": adapters,
            "rank": RANK,
            "alpha": ALPHA,
            "dtype": args.dtype,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_prompts": args.num_prompts,
            "passes": args.passes,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "quick": args.quick,
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": ops["machine"],
        "ops": ops["ops"],
        "cases": results,
        "summary": summarize(results, ops["ops"]),
    }
    from bench.suites.lora_report import write_report

    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
