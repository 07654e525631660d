"""Prefix caching on hybrid models: time to first token of a ~4k-token prompt sent once (cold),
sent again (re-sent), and sent again with 64 tokens appended (extended, an agent's next turn),
with prefix caching on against off, on Qwen3-Next (Gated DeltaNet) and Granite 4.0-H (Mamba-2).

The checkpoints are the hybrid suite's (`bench.suites.hybrid_models.write_hybrid_model`: 8 layers
of hidden 1024, three state layers then one attention layer, twice; MoE blocks; random weights;
float32). With prefix caching on, vLLM's "align" mamba cache mode leaves the recurrent state at
block boundaries in its state pages (`vllm_metal.kv.state`); vLLM keeps by default only each
prompt's last boundary state (`prefix_cache_retention_interval=0`), which is what a re-sent or
extended prompt hits. A hit starts from the last block boundary before the prompt's last token,
so the tokens after it are computed again: `num_cached_tokens` says how many were not.

Each (family, caching) is one `vllm.LLM` in a worker process (`bench.harness.workers`), both of a
family started at once and given the same requests in turn (the first engine alternating from
repeat to repeat), each once the other worker is idle again: on a new random prompt P each
time, P (cold), P (re-sent), P + 64 new tokens (extended); once to warm up on a P of one prefill
chunk (not measured), then `--repeats` times. Every request is greedy, EOS ignored, 4 tokens
out; TTFT is vLLM's `first_token_latency`. The engines have the same arguments but
`enable_prefix_caching` (`max_num_batched_tokens` 2048, 1 GiB of KV cache, one request at a
time).

The run fails unless every request's `num_cached_tokens` is what the block size gives (on: 0 for
a cold P, the last boundary before the prompt's last token otherwise; off: 0), a re-sent P's
tokens equal its cold tokens, and (both engines run) each request's first token is the same with
caching on and off.

    python -m bench.run hybrid_prefix --out docs/benchmarks                # ~10 min on 2 cores
    python -m bench.run hybrid_prefix --quick --out /tmp/hybrid-prefix-q   # tiny model, the harness

`--quick`: the tests' tiny Qwen3-Next, 320-token prompts plus 16, chunks of 128, one repeat,
and the caching-on engine alone (the one measured; its hits and exactness are
checked); `--quick --peers` adds the caching-off engine (the baseline: ratios and the
first-token check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.stages import (
    chosen_families,
    command_line,
    describe_machine_apart,
    run_families,
    runs_peers,
    suite_parser,
)
from bench.suites.hybrid_describe import describe_hybrid_model
from bench.suites.hybrid_models import DTYPE, write_hybrid_model

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

FAMILIES = ("qwen3_next", "granite")
CACHING = ("on", "off")  # "on" is measured; "off" is the baseline (run in full runs, --peers)
REQUESTS = ("cold", "resent", "extended")
MAX_TOKENS = 4
# By --quick: prompt tokens, appended tokens, prefill chunk, measured repeats.
DEFAULTS = {
    False: {"input_len": 4096, "extend_len": 64, "chunk": 2048, "repeats": 2},
    True: {"input_len": 320, "extend_len": 16, "chunk": 128, "repeats": 1},
}
KV_CACHE_BYTES = {False: 2**30, True: 256 * 2**20}
# The plugin's log line when it raises the block size to hold a state page (`kv.state`).
_BLOCK_LINE = re.compile(r"KV block size (\d+) -> (\d+) tokens")


def block_size(log: str) -> int | None:
    """The KV block size the engine ran with, from the plugin's log line (None if not logged)."""
    found = _BLOCK_LINE.findall(Path(log).read_text(encoding="utf-8", errors="replace"))
    return int(found[-1][1]) if found else None


def expected_cached(caching: str, request: str, input_len: int, block: int) -> int:
    """The tokens a request should find cached: with caching on, a re-sent or extended P hits
    P's last boundary state, the last block boundary before P's last token."""
    if caching == "off" or request == "cold":
        return 0
    return (input_len - 1) // block * block


def prompts(args: argparse.Namespace) -> list[list[int]]:
    """The workers' inputs: P and P + appended tokens of each repeat, the warm-up's first (its P
    one prefill chunk long)."""
    from bench.harness.single_stream import make_prompts

    out = []
    for k, p in enumerate(make_prompts(args.repeats + 1, args.input_len + args.extend_len,
                                       args.seed)):  # fmt: skip
        n = args.chunk if k == 0 else args.input_len
        out += [p[:n], p[: n + args.extend_len]]
    return out


def index(request: str, repeat: int) -> int:
    """Where a repeat's request is in `prompts` (repeat 0: the warm-up)."""
    return 2 * repeat + (request == "extended")


# ------------------------------------------------------------------------------ one family


def run_family(args: argparse.Namespace, family: str, logs: Path) -> dict[str, Any]:
    from bench.harness.decode_rounds import engine_args, kv_log
    from bench.harness.stages import blas_log_lines
    from bench.harness.workers import Worker, close_all

    print(f"[hybrid_prefix] {family}: checkpoint", flush=True)
    model = write_hybrid_model(Path(args.work_dir), family, args.quick, args.seed)
    logs.mkdir(parents=True, exist_ok=True)
    inputs = logs / "prompts.json"
    inputs.write_text(json.dumps(prompts(args)))
    model_len = args.input_len + args.extend_len + MAX_TOKENS + 16
    base = {**engine_args(model, DTYPE, KV_CACHE_BYTES[args.quick], model_len, args.quick, 1),
            "max_num_batched_tokens": args.chunk,
            # The checkpoints say 2,048 positions (the tests' writers); RoPE has no limit.
            "hf_overrides": {"max_position_embeddings": max(2048, model_len)}}  # fmt: skip
    engines = {c: {**base, "enable_prefix_caching": c == "on"} for c in CACHING}
    cachings = CACHING if runs_peers(args) else ("on",)
    print(f"[hybrid_prefix] {family}: starting {', '.join(cachings)}", flush=True)
    workers = {c: Worker(f"{family}_{c}", "plugin", engines[c], inputs, logs / f"{family}_{c}.log",
                         args.timeout) for c in cachings}  # fmt: skip
    replies: dict[str, dict[str, list[dict]]] = {c: {r: [] for r in REQUESTS} for c in cachings}
    try:
        ready = {c: w.receive() for c, w in workers.items()}

        def send(k: int, start: int) -> dict[str, dict]:
            out = {}
            for c in cachings if k % 2 == 0 else cachings[::-1]:
                out[c] = workers[c].call(op="generate", start=start, n=1, max_tokens=MAX_TOKENS)
                workers[c].settle()
            return out

        for k in range(args.repeats + 1):
            for request in REQUESTS:
                for c, r in send(k, index(request, k)).items():
                    if k == 0:  # the warm-up
                        ready[c].setdefault("warmup_ttft_s", []).append(r["ttft_ms"][0] / 1e3)
                        continue
                    replies[c][request].append(r)
                    print(f"[hybrid_prefix] {family} {c} {request} {k}: TTFT "
                          f"{r['ttft_ms'][0] / 1e3:.3f} s, {r['num_cached_tokens'][0]} cached",
                          flush=True)  # fmt: skip
    finally:
        close_all(list(workers.values()))

    worker_info = {}
    for c, w in workers.items():
        text = w.log.read_text(encoding="utf-8", errors="replace")
        worker_info[c] = {**ready[c], "log": str(w.log), "kv": kv_log(str(w.log)),
                          "block_size": block_size(str(w.log)),
                          "cpu_blas_logged": blas_log_lines(text)}  # fmt: skip
    requests = {
        request: {
            c: {
                "ttft_s": [r["ttft_ms"][0] / 1e3 for r in replies[c][request]],
                "median_ttft_s": statistics.median(r["ttft_ms"][0] / 1e3
                                                   for r in replies[c][request]),
                "num_cached_tokens": [r["num_cached_tokens"][0] for r in replies[c][request]],
                "token_ids": [r["token_ids"][0] for r in replies[c][request]],
            }
            for c in cachings
        }
        for request in REQUESTS
    }  # fmt: skip
    return {
        "model": describe_hybrid_model(model),
        "engine": engines,
        "workers": worker_info,
        "requests": requests,
        "problems": check(args, requests, worker_info),
    }


def check(
    args: argparse.Namespace, requests: dict[str, dict], workers: dict[str, dict]
) -> list[str]:
    """What is wrong with a family's figures (nothing when every hit was the expected one and
    caching changed no token)."""
    problems = []
    for c, w in workers.items():
        block = w["block_size"]
        if block is None:
            problems.append(f"{c}: the engine logged no raised block size; hits not checked")
            continue
        for request in REQUESTS:
            want = expected_cached(c, request, args.input_len, block)
            got = requests[request][c]["num_cached_tokens"]
            if got != [want] * len(got):
                problems.append(f"caching {c}, {request}: num_cached_tokens {got}, want {want}")
    for c in workers:
        cold, resent = (requests[r][c]["token_ids"] for r in ("cold", "resent"))
        if cold != resent:
            problems.append(f"caching {c}: a re-sent P's tokens differ from its cold tokens")
    if len(workers) == 2:
        for request in REQUESTS:
            on, off = (requests[request][c]["token_ids"] for c in CACHING)
            if [t[0] for t in on] != [t[0] for t in off]:
                problems.append(f"{request}: first tokens differ with caching on and off")
    return problems


def summarize(families: dict[str, dict], settings: dict[str, Any]) -> dict[str, Any]:
    """Per family and request: the median TTFTs, cached / uncached, the hits and the prompt
    tokens computed after them, tokens agreeing."""
    out: dict[str, Any] = {}
    for family, r in families.items():
        s: dict[str, Any] = {}
        for request, by in r["requests"].items():
            on, off = by["on"], by.get("off")
            n = settings["input_len"] + (settings["extend_len"] if request == "extended" else 0)
            s[request] = {
                "prompt_tokens": n,
                "computed_tokens": n - min(on["num_cached_tokens"]),
                "on_median_ttft_s": on["median_ttft_s"],
                "off_median_ttft_s": off["median_ttft_s"] if off else None,
                "on_vs_off": on["median_ttft_s"] / off["median_ttft_s"] if off else None,
                "num_cached_tokens": on["num_cached_tokens"],
                "tokens_identical": (sum(a == b for a, b in zip(on["token_ids"], off["token_ids"]))
                                     if off else None),
            }  # fmt: skip
        out[family] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("hybrid_prefix", __doc__, "tiny Qwen3-Next: checks the harness")
    p.add_argument("--families", default=None,
                   help="comma-separated subset: all (qwen3_next with --quick)")  # fmt: skip
    for key, what in (("input_len", "prompt tokens"), ("extend_len", "tokens appended"),
                      ("chunk", "max_num_batched_tokens"),
                      ("repeats", "measured prompts per family")):  # fmt: skip
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None,
                       help=f"{what}: {DEFAULTS[False][key]} ({DEFAULTS[True][key]})")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker reply")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.quick].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.families is None:
        args.families = "qwen3_next" if args.quick else ",".join(FAMILIES)
    families = chosen_families(p, args.families, FAMILIES)

    started = time.perf_counter()
    started_utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    logs = Path(args.work_dir) / ("hybrid-prefix-quick" if args.quick else "hybrid-prefix")
    logs.mkdir(parents=True, exist_ok=True)
    print("[hybrid_prefix] machine", flush=True)
    machine = describe_machine_apart(logs)
    results = run_families(families, lambda family: run_family(args, family, logs / family))
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            **{key: getattr(args, key) for key in DEFAULTS[False]},
            "max_tokens": MAX_TOKENS,
            "seed": args.seed,
            "cachings": list(CACHING if runs_peers(args) else ("on",)),
            "command": command_line("hybrid_prefix", argv),
            "started_utc": started_utc,
            "total_seconds": round(time.perf_counter() - started, 1),
            # Other work on the machine shows here more than in the load at start.
            "load_average_at_end": list(os.getloadavg()),
        },
        "machine": machine,
        "families": results,
        "problems": [f"{f}: {x}" for f, r in results.items() for x in r["problems"]],
    }
    report["summary"] = summarize(results, report["settings"])
    from bench.suites.hybrid_prefix_report import write_report

    write_report(report, Path(args.out))
    for problem in report["problems"]:
        print(f"[hybrid_prefix] CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
