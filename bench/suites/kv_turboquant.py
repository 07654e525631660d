"""TurboQuant KV caches against the unquantized one, side by side in one run: the tokens one fixed
KV budget holds, decode tok/s at a long context, and the cache write and paged attention over
TurboQuant and unquantized pools.

Run: python -m bench.run kv_turboquant [--quick] [--out DIR]

Engines of the plugin on one checkpoint, the same engine arguments but `kv_cache_dtype` (auto and
each preset of `--caches`), each in a worker process, started together: the KV cache size each
logs for the budget, then the same decode rounds sent to each in turn (the order rotating each
round), each once the others are idle (`--streams` requests of `--context` prompt tokens,
`--output-len` tokens each; decode tok/s = streams / median TPOT, prefill left out). vLLM keeps
the first and last two layers of a dense model at the model's dtype (its boundary protection), so
the 8-layer 0.17b checkpoint stores TurboQuant slots in 4 layers; `docs/kv-cache.md` gives the
bytes per token of larger models. Then a process of its own times the ops (one decode row per
sequence) over pools of one attention layer's shape, interleaved call by call. The checkpoint is
float32 by default (`--dtype`), as in the fp8 suite. The machine is shared: read the ratios,
measured side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness.stages import command_line, python_stage, suite_parser

STEM = "kv_turboquant"
PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = suite_parser(STEM, __doc__.splitlines()[0], "short context, one round")
    p.add_argument("--size", default="0.17b", help="benchmark checkpoint (0.17b: 8 layers)")
    p.add_argument(
        "--dtype", default="float32", help="the checkpoint's, which the unquantized cache stores"
    )
    p.add_argument("--caches", default=None, help="presets beside auto (all; two --quick)")
    p.add_argument("--kv-budget-mib", type=int, default=None, help="KV memory (512; 64 --quick)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (2048; 256 --quick)")
    p.add_argument("--streams", type=int, default=None, help="requests per round (2)")
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (16; 4)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per engine (2; 1 --quick)")
    p.add_argument("--op-reps", type=int, default=None, help="timed op calls (20; 3 --quick)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker reply")
    p.add_argument("--op-stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "caches": "turboquant_k8v4,turboquant_3bit_nc" if quick else ",".join(PRESETS),
        "kv_budget_mib": 64 if quick else 512,
        "context": 256 if quick else 2048,
        "streams": 2,
        "output_len": 4 if quick else 16,
        "rounds": 1 if quick else 2,
        "op_reps": 3 if quick else 20,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.cache_list = ["auto", *[c for c in args.caches.split(",") if c]]
    return args


def engine_rounds(args: argparse.Namespace, model: dict[str, Any], work: Path) -> dict[str, Any]:
    """Every engine: KV cache size for the budget, then the decode rounds, in rotating order."""
    from bench.harness.decode_rounds import kv_log
    from bench.harness.single_stream import make_prompts
    from bench.harness.workers import Worker, close_all

    n, caches = args.streams, args.cache_list
    # Round 0 warms the engines up on short prompts (a long prefill costs minutes on the CPU).
    prompts = make_prompts(n, 64, seed=1) + make_prompts(n * args.rounds, args.context, seed=0)
    inputs = work / f"{STEM}_prompts.json"
    inputs.write_text(json.dumps(prompts))
    engine = {
        "model": model["path"],
        "dtype": model["dtype"],
        "max_model_len": args.context + args.output_len + 16,
        "max_num_seqs": n,
        "max_num_batched_tokens": max(2048, args.context),
        "kv_cache_memory_bytes": args.kv_budget_mib * 2**20,
        "enable_prefix_caching": False,
        "disable_log_stats": False,  # per-request metrics (TPOT)
        "seed": 0,
    }
    workers, logs = {}, {}
    for cache in caches:
        logs[cache] = work / f"{STEM}_{cache}.log"
        workers[cache] = Worker(cache, "mlx", dict(engine, kv_cache_dtype=cache), inputs,
                                logs[cache], args.timeout)  # fmt: skip
    try:
        ready = {cache: w.receive() for cache, w in workers.items()}
        calls: dict[str, list[dict[str, Any]]] = {cache: [] for cache in caches}
        for r in range(args.rounds + 1):  # round 0: the warm-up
            order = caches[r % len(caches) :] + caches[: r % len(caches)]
            for cache in order:
                workers[cache].settle()
                reply = workers[cache].call(op="generate", start=r * n, n=n,
                                            max_tokens=args.output_len)  # fmt: skip
                if r > 0:
                    calls[cache].append(reply)
    finally:
        close_all(list(workers.values()))
    result: dict[str, Any] = {}
    for cache in caches:
        tpot = [t for reply in calls[cache] for t in reply["tpot_ms"]]
        median = statistics.median(tpot)
        result[cache] = {
            **kv_log(str(logs[cache])),
            "engine_start_s": ready[cache]["engine_start_s"],
            "platform": ready[cache]["platform"],
            "tpot_ms": [round(t, 2) for t in tpot],
            "median_tpot_ms": round(median, 2),
            "decode_tok_s": round(n * 1e3 / median, 2),
            "tokens": [reply["tokens"] for reply in calls[cache]],
            "token_ids": calls[cache][0]["token_ids"],
        }
    return result


def op_stage(args: argparse.Namespace, model: dict[str, Any]) -> dict[str, Any]:
    """The cache write and paged attention (decode rows) over one layer's pools: `ops` over the
    model's dtype, `ops.turboquant` over each preset, `streams` sequences of `context` keys."""
    import mlx.core as mx
    import numpy as np

    from vllm_metal import ops
    from vllm_metal.kv.turboquant import format_for
    from vllm_metal.ops import turboquant

    hq, hkv, d = model["num_heads"], model["num_kv_heads"], model["head_dim"]
    s, ctx, bs = args.streams, args.context, 16
    blocks = -(-ctx // bs)
    rng = np.random.default_rng(0)
    tables = mx.array(np.arange(s * blocks, dtype=np.int32).reshape(s, blocks))
    seq_lens = mx.array(np.full(s, ctx, np.int32))
    cu = mx.array(np.arange(s + 1, dtype=np.int32))
    dtype = getattr(mx, model["dtype"])
    query = mx.array(rng.standard_normal((s, hq, d)).astype(np.float32)).astype(dtype)
    rows = mx.array(rng.standard_normal((s, hkv, d)).astype(np.float32)).astype(dtype)
    slots = mx.array((np.arange(s) * blocks * bs + ctx - 1).astype(np.int64))
    full = mx.array(rng.standard_normal((s * blocks * bs, hkv, d)).astype(np.float32))
    all_slots = mx.array(np.arange(s * blocks * bs, dtype=np.int64))
    calls: dict[str, tuple[Any, Any]] = {}
    pool_bytes: dict[str, int] = {}
    for cache in args.cache_list:
        if cache == "auto":
            shape = (s * blocks, bs, hkv, d)
            kv = ops.reshape_and_cache(full.astype(dtype), full.astype(dtype),
                                       mx.zeros(shape, dtype), mx.zeros(shape, dtype), all_slots)  # fmt: skip
            attend, write = ops.paged_attention, ops.reshape_and_cache
            options: dict[str, Any] = {}
        else:
            fmt = format_for(cache, d)
            kc = mx.zeros((s * blocks, bs, hkv, fmt.key_bytes), mx.uint8)
            vc = mx.zeros((s * blocks, bs, hkv, fmt.value_bytes), mx.uint8)
            kv = turboquant.reshape_and_cache(full, full, kc, vc, all_slots, fmt=fmt)
            attend, write = turboquant.paged_attention, turboquant.reshape_and_cache
            options = {"fmt": fmt}
        mx.eval(*kv)
        pool_bytes[cache] = int(kv[0].nbytes + kv[1].nbytes)
        calls[cache] = (
            partial(attend, query, *kv, tables, seq_lens, cu, scale=d**-0.5, max_query_len=1,
                    **options),
            partial(write, rows, rows, *kv, slots, padded=False, **options),
        )  # fmt: skip

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - t0) * 1e3

    attention: dict[str, list[float]] = {c: [] for c in args.cache_list}
    write_ms: dict[str, list[float]] = {c: [] for c in args.cache_list}
    for rep in range(args.op_reps + 1):  # rep 0 warms up
        for cache in args.cache_list if rep % 2 == 0 else args.cache_list[::-1]:
            a, w = timed(calls[cache][0]), timed(calls[cache][1])
            if rep:
                attention[cache].append(a)
                write_ms[cache].append(w)
    return {
        "backend": ops.backend(),
        # How the presets' decode rows read their slots: the native op unpacks them in the
        # kernel; the reference ops gather and dequantize the pages first.
        "turboquant_reads": "in the kernel" if ops.backend() == "native" else "gathered",
        "device": str(mx.default_device()),
        "shape": {
            "seqs": s,
            "keys": ctx,
            "q_heads": hq,
            "kv_heads": hkv,
            "head_dim": d,
            "block_size": bs,
        },
        "attention_ms": {c: round(statistics.median(v), 3) for c, v in attention.items()},
        "cache_write_ms": {c: round(statistics.median(v), 3) for c, v in write_ms.items()},
        "pool_bytes": pool_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.harness.checkpoints import describe_model, write_model

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = describe_model(write_model(work / "models", args.size, args.dtype))
    if args.op_stage:
        Path(args.json).write_text(json.dumps(op_stage(args, model)))
        return 0
    from bench.harness.machine import describe_machine
    from bench.suites.kv_turboquant_report import write_report

    started = time.perf_counter()
    machine = describe_machine()
    engines = engine_rounds(args, model, work)
    stage_argv = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                  for k in ("size", "dtype", "caches", "context", "streams", "op_reps")]  # fmt: skip
    stage_argv += ["--op-stage", "--work-dir", str(work)]
    op = python_stage(f"bench.suites.{STEM}", stage_argv, args.timeout, work / f"{STEM}_ops.log")
    report = {
        "settings": {
            "command": command_line(STEM, argv),
            "quick": args.quick,
            "dtype": args.dtype,
            "caches": args.cache_list,
            "kv_budget_mib": args.kv_budget_mib,
            "context": args.context,
            "streams": args.streams,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "op_reps": args.op_reps,
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "model": model,
        "engines": engines,
        "ops": op,
    }
    write_report(report, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
