"""fp8 KV cache against the unquantized one, side by side in one run: the tokens one fixed KV budget
holds, decode tok/s at a long context, and the native ops over fp8 and unquantized pools.

Run: python -m bench.run kv_fp8 [--quick] [--out DIR]

Two engines of the plugin on one checkpoint, the same engine arguments but `kv_cache_dtype` (auto,
fp8), each in a worker process, started together: the KV cache size each logs for the budget, then
the same decode rounds sent to both in turn (the first engine alternating), each once the other is
idle (`--streams` requests of `--context` prompt tokens, `--output-len` tokens each; decode tok/s =
streams / median TPOT, prefill left out). Then a process of its own times `ops.paged_attention`
(one decode row per sequence) and `ops.reshape_and_cache` over unquantized and fp8 pools of the
same shape, interleaved call by call. The checkpoint is float32 by default (`--dtype`): MLX's
bfloat16 matmuls run its own slow loops on this CPU, which would make the long prefills take most
of an hour; the unquantized cache then stores four bytes per element, fp8 one. The machine is shared: read the ratios, measured side by side.
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

STEM = "kv_fp8"
CACHES = ("auto", "fp8")


def parse_args(
    argv: list[str] | None, name: str = STEM, description: str | None = None
) -> argparse.Namespace:
    p = suite_parser(
        name, description or __doc__.splitlines()[0], "the tiny model, short context, one round"
    )
    p.add_argument(
        "--size", default=None, help="benchmark checkpoint (default 0.17b; tiny --quick)"
    )
    p.add_argument(
        "--dtype", default="float32", help="the checkpoint's, which the unquantized cache stores"
    )
    p.add_argument("--kv-budget-mib", type=int, default=None, help="KV memory (512; 64 --quick)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (4096; 256 --quick)")
    p.add_argument("--streams", type=int, default=None, help="requests per round (2)")
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (16; 4)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per engine (2; 1 --quick)")
    p.add_argument("--op-reps", type=int, default=None, help="timed op calls (30; 3 --quick)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker reply")
    p.add_argument("--caches", default=",".join(CACHES), help=argparse.SUPPRESS)
    p.add_argument("--op-stage", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "size": "tiny" if quick else "0.17b",
        "kv_budget_mib": 64 if quick else 512,
        "context": 256 if quick else 4096,
        "streams": 2,
        "output_len": 4 if quick else 16,
        "rounds": 1 if quick else 2,
        "op_reps": 3 if quick else 30,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.caches = tuple(args.caches.split(","))
    return args


def engine_rounds(args: argparse.Namespace, model: dict[str, Any], work: Path) -> dict[str, Any]:
    """An engine per cache of `args.caches`: KV cache size for the budget, then the decode rounds,
    in turn (the order reversed every other round)."""
    from bench.harness.decode_rounds import kv_log
    from bench.harness.single_stream import make_prompts
    from bench.harness.workers import Worker, close_all

    n = args.streams
    # Round 0 warms both engines up on short prompts (a long prefill costs minutes on the CPU).
    prompts = make_prompts(n, 64, seed=1) + make_prompts(n * args.rounds, args.context, seed=0)
    caches = args.caches
    inputs = work / "kv_fp8_prompts.json"
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
        logs[cache] = work / f"kv_fp8_{cache}.log"
        workers[cache] = Worker(cache, "mlx", dict(engine, kv_cache_dtype=cache), inputs,
                                logs[cache], args.timeout)  # fmt: skip
    try:
        ready = {cache: w.receive() for cache, w in workers.items()}
        calls: dict[str, list[dict[str, Any]]] = {cache: [] for cache in caches}
        for r in range(args.rounds + 1):  # round 0: the warm-up
            order = caches if r % 2 == 0 else caches[::-1]
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
    """ops.paged_attention (decode rows) and ops.reshape_and_cache over pools of the model's dtype
    and quantized pools (`args.caches`) of its attention shape, `streams` sequences of `context`
    keys, calls interleaved."""
    import mlx.core as mx
    import numpy as np

    from vllm_metal import ops
    from vllm_metal.ops import per_token_head

    caches = args.caches

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
    pools: dict[str, list[mx.array]] = {}
    for cache in caches:
        quant = {} if cache == "auto" else {"kv_cache_dtype": cache, "k_scale": 1.0, "v_scale": 1.0}
        pool = dtype if cache == "auto" else mx.uint8
        width = per_token_head.row_bytes(cache, d) if per_token_head.is_per_token_head(cache) else d
        shape = (s * blocks, bs, hkv, width)
        kv = [mx.zeros(shape, pool), mx.zeros(shape, pool)]
        full = mx.array(rng.standard_normal((s * blocks * bs, hkv, d)).astype(np.float32))
        full = full.astype(dtype)
        all_slots = mx.array(np.arange(s * blocks * bs, dtype=np.int64))
        kv = list(ops.reshape_and_cache(full, full, *kv, all_slots, **quant))
        mx.eval(*kv)
        pools[cache] = kv

    def timed(fn: Any) -> float:
        t0 = time.perf_counter()
        mx.eval(fn())
        return (time.perf_counter() - t0) * 1e3

    attention: dict[str, list[float]] = {c: [] for c in caches}
    write: dict[str, list[float]] = {c: [] for c in caches}
    for rep in range(args.op_reps + 1):  # rep 0 warms up
        for cache in caches if rep % 2 == 0 else caches[::-1]:
            quant = {} if cache == "auto" else {"kv_cache_dtype": cache}
            kc, vc = pools[cache]
            a = timed(partial(ops.paged_attention, query, kc, vc, tables, seq_lens, cu,
                              scale=d**-0.5, **quant))  # fmt: skip
            w = timed(partial(ops.reshape_and_cache, rows, rows, kc, vc, slots, **quant))
            if rep:
                attention[cache].append(a)
                write[cache].append(w)
    return {
        "backend": ops.backend(),
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
        "cache_write_ms": {c: round(statistics.median(v), 3) for c, v in write.items()},
        "pool_bytes": {c: int(pools[c][0].nbytes) * 2 for c in caches},
    }


def main(argv: list[str] | None = None) -> int:
    from bench.suites.kv_fp8_report import write_report

    return run(parse_args(argv), argv, STEM, write_report)


def run(args: argparse.Namespace, argv: list[str] | None, stem: str, write_report: Any) -> int:
    """The suite `stem` over `args.caches`, its report written by `write_report(report, out)`."""
    from bench.harness.checkpoints import describe_model, write_model

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = describe_model(write_model(work / "models", args.size, args.dtype))
    if args.op_stage:
        Path(args.json).write_text(json.dumps(op_stage(args, model)))
        return 0
    from bench.harness.machine import describe_machine

    started = time.perf_counter()
    machine = describe_machine()
    engines = engine_rounds(args, model, work)
    stage_argv = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                  for k in ("size", "dtype", "context", "streams", "op_reps")]  # fmt: skip
    stage_argv += ["--caches", ",".join(args.caches), "--op-stage", "--work-dir", str(work)]
    op = python_stage("bench.suites.kv_fp8", stage_argv, args.timeout, work / f"{stem}_ops.log")
    report = {
        "settings": {
            "command": command_line(stem, argv),
            "quick": args.quick,
            "dtype": args.dtype,
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
