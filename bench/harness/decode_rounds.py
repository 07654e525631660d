"""Decode rounds side by side: the measuring part of the moe, hybrid and torch_backend suites.

One `vllm.LLM` per backend, each in a worker process of its own (`bench.harness.workers`;
`VLLM_TARGET_DEVICE=cpu` for the "cpu" backend), all started at once and given the same engine
arguments. This process then sends them the same rounds in turn (the first backend alternating
from round to round), each once the previous round's worker is idle again: one warm-up round of
each size, then `--c1-rounds` rounds of 1 request and `--c16-rounds` rounds of 16 requests at
once, every request its own prompt. Decode tok/s = streams / median TPOT (vLLM's per-request
metrics: first to last token over the tokens between them, so prefill is left out); output tok/s
(tokens / wall time of a round, prefill included) beside it. With two backends, their greedy
tokens of the first 16-stream round are compared (:func:`agreement`). A suite may choose other
stream counts than 1 and 16 (`round_parser(streams=...)`; its many-stream rounds are then
`--c<N>-rounds`) and run its backends one after another (one `run` per backend,
`keep_tokens=True` for the tokens to compare).

The caller names the model (a description with its `path`, and `kv_bytes_per_token` unless it
gives the KV cache size) and the backends. Nothing here imports the plugin or MLX: the parent must
not run MLX before it starts engines.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STREAMS = (1, 16)


def round_parser(name: str, description: str | None, quick_help: str,
                 streams: Sequence[int] = STREAMS) -> argparse.ArgumentParser:  # fmt: skip
    """The command line of decode-round suite `name`: a suite's options (`suite_parser`),
    lengths and rounds (`fill_round_defaults` after parsing). `streams`: the round sizes, 1 and
    N (`args.streams`; N's rounds are `--c<N>-rounds`)."""
    from bench.harness.stages import suite_parser

    p = suite_parser(name, description, quick_help)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--c1-rounds", type=int, default=None, help="single-stream rounds: 3 (1)")
    big = max(streams)
    p.add_argument(f"--c{big}-rounds", type=int, default=None, help=f"{big}-stream rounds: 2 (1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker reply")
    p.set_defaults(streams=tuple(streams))
    return p


def fill_round_defaults(args: argparse.Namespace) -> None:
    """Output length and rounds left unset: 64 tokens, 3 and 2 rounds (8, 1 and 1 `--quick`)."""
    if args.output_len is None:
        args.output_len = 8 if args.quick else 64
    if args.c1_rounds is None:
        args.c1_rounds = 1 if args.quick else 3
    many = f"c{max(args.streams)}_rounds"
    if getattr(args, many) is None:
        setattr(args, many, 1 if args.quick else 2)


def max_model_len(args: argparse.Namespace) -> int:
    """The engines' max_model_len: a prompt, its output and 16 tokens of room."""
    return args.input_len + args.output_len + 16


def engine_args(model: Path | str, dtype: str, kv_cache_bytes: int, max_model_len: int,
                eager: bool, max_num_seqs: int = max(STREAMS)) -> dict[str, Any]:  # fmt: skip
    """The same `vllm.LLM` arguments for every backend."""
    return {
        "model": str(model),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "enable_prefix_caching": False,  # distinct prompts anyway; no backend may skip work
        "enforce_eager": eager,
        "disable_log_stats": False,  # per-request metrics (TPOT)
        "seed": 0,
    }


def agreement(first: list[list[int]], second: list[list[int]]) -> dict[str, Any]:
    """How far two backends' greedy continuations of the same prompts agree (`first` is the
    plugin's: its distinct continuations are counted)."""

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    prefixes = [common(a, b) for a, b in zip(first, second)]
    return {
        "requests": len(prefixes),
        "identical": sum(a == b for a, b in zip(first, second)),
        "first_token_equal": sum(p >= 1 for p in prefixes),
        "common_prefix_tokens": prefixes,
        "distinct_continuations": len({tuple(a) for a in first}),
        # Random weights: a near-tie (router or LM head) may flip a later token between two
        # float32 implementations; every first token must agree.
        "passed": all(p >= 1 for p in prefixes),
    }


def run(
    args: argparse.Namespace,
    desc: dict[str, Any],
    logs: Path,
    *,
    backends: Sequence[str],
    tag: str,
    dtype: str,
    kv_cache_bytes: int | None = None,
    keep_tokens: bool = False,
    backend_engine: Mapping[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Start one worker per backend on the model `desc` describes, run the rounds, return the
    model, engine arguments, workers, cases and (with two backends) the agreement.

    `args`: streams (`round_parser`'s), input_len, output_len, c1_rounds, c<N>_rounds, seed,
    timeout, quick (`enforce_eager`). `kv_cache_bytes`: default room for N full sequences at
    `desc["kv_bytes_per_token"]`. `keep_tokens`: also return each backend's greedy tokens of the
    first N-stream round (`token_ids`). `backend_engine`: engine arguments one backend takes
    besides the common ones. Workers are named `<tag>_<backend>` and log to
    `logs/<tag>_<backend>.log`.
    """
    from bench.harness.single_stream import make_prompts
    from bench.harness.stages import blas_log_lines, kv_bytes
    from bench.harness.workers import Worker, close_all

    backends = tuple(backends)
    streams = tuple(args.streams)
    big = max(streams)
    rounds = {1: args.c1_rounds, big: getattr(args, f"c{big}_rounds")}
    # Warm-up: one round of each size; then the measured rounds. Every request its own prompt.
    num_prompts = sum(streams) + sum(n * r for n, r in rounds.items())
    inputs = logs / "prompts.json"
    inputs.write_text(json.dumps(make_prompts(num_prompts, args.input_len, args.seed)))
    model_len = max_model_len(args)
    if kv_cache_bytes is None:
        kv_cache_bytes = kv_bytes(desc, model_len, big)
    engine = engine_args(desc["path"], dtype, kv_cache_bytes, model_len, args.quick, big)

    print(f"[{tag}] starting {len(backends)} worker(s): {', '.join(backends)}", flush=True)
    started = time.perf_counter()
    extra = backend_engine or {}
    workers = {be: Worker(f"{tag}_{be}", be, {**engine, **extra.get(be, {})}, inputs,
                          logs / f"{tag}_{be}.log", args.timeout) for be in backends}  # fmt: skip
    nxt = 0
    try:
        ready = {be: w.receive() for be, w in workers.items()}
        all_ready_s = time.perf_counter() - started

        def round_robin(n: int, k: int, max_tokens: int) -> dict[str, dict]:
            nonlocal nxt
            start, nxt = nxt, nxt + n
            order = backends if k % 2 == 0 else backends[::-1]
            out = {}
            for be in order:
                out[be] = workers[be].call(op="generate", start=start, n=n, max_tokens=max_tokens)
                out[be]["busy_after_s"] = workers[be].settle()
            return out

        for n in streams:
            for be, r in round_robin(n, 0, 4).items():
                ready[be].setdefault("warmup_s", []).append(round(r["seconds"], 3))
        calls: dict[int, dict[str, list[dict]]] = {n: {be: [] for be in backends} for n in streams}
        for n in streams:
            print(f"[{tag}] {rounds[n]} round(s) of {n} stream(s) per backend", flush=True)
            for k in range(rounds[n]):
                for be, r in round_robin(n, k, args.output_len).items():
                    calls[n][be].append(r)
    finally:
        close_all(list(workers.values()))

    out_cases: dict[str, dict[str, Any]] = {}
    for n in streams:
        for be in backends:
            rs = calls[n][be]
            tpots = [t for r in rs for t in r["tpot_ms"]]
            counts = [c for r in rs for c in r["tokens"]]
            assert counts == [args.output_len] * len(counts), (n, be, counts)
            tpot = statistics.median(tpots)
            out_cases[f"c{n}_{be}"] = {
                "streams": n,
                "backend": be,
                "rounds": len(rs),
                "median_tpot_ms": tpot,
                "decode_tok_s": n * 1e3 / tpot,
                "output_tok_s": statistics.median(sum(r["tokens"]) / r["seconds"] for r in rs),
                "median_ttft_ms": statistics.median(t for r in rs for t in r["ttft_ms"]),
                "round_s": [round(r["seconds"], 3) for r in rs],
                "busy_after_call_s": statistics.median(r["busy_after_s"] for r in rs),
            }
    check = None
    if len(backends) == 2:
        first, second = (calls[big][be][0]["token_ids"] for be in backends)
        check = agreement(first, second)
    worker_info = {}
    for be, w in workers.items():
        text = w.log.read_text(encoding="utf-8", errors="replace")
        bound = re.search(r"core ids=\[([^\]]*)\]", text)
        worker_info[be] = {**ready[be], "log": str(w.log), "cpu_blas_logged": blas_log_lines(text),
                           "omp_bound_cores": bound.group(1) if bound else None}  # fmt: skip
    result = {
        "model": desc,
        "engine": engine,
        "workers": worker_info,
        "both_ready_s" if len(backends) == 2 else "all_ready_s": round(all_ready_s, 1),
        "cases": out_cases,
        "agreement": check,
    }
    if keep_tokens:
        result["token_ids"] = {be: calls[big][be][0]["token_ids"] for be in backends}
    return result


def kv_log(path: str) -> dict[str, Any]:
    """What the engine logged about its KV cache: size in tokens and how many requests of
    max_model_len fit at once (fewer than 16 would let the 16-stream rounds preempt)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    size = re.findall(r"KV cache size: ([\d,]+) tokens", text)
    conc = re.findall(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text)
    preempt = len(re.findall(r"preempt", text, flags=re.IGNORECASE))
    return {
        "kv_cache_tokens": int(size[-1].replace(",", "")) if size else None,
        "max_concurrency": float(conc[-1][1]) if conc else None,
        "log_lines_mentioning_preemption": preempt,
    }
