"""Data and pipeline parallelism on one host: the aggregate output tok/s of `vllm serve -dp 2`
against one replica on the same cores, and the time per output token that `-pp 2` adds to one
process, one run.

Servers (`SERVERS`), each one `vllm serve` of the same checkpoint with the same arguments
(`--max-num-seqs 8 --no-enable-prefix-caching --kv-cache-memory-bytes ...`, the KV size per
replica and per stage), on this machine's cores:

- `one`: one engine process, the baseline (the model runs in the engine process: vLLM's `uni`
  executor, the plugin's default for one process);
- `one_mp`: the same with `--distributed-executor-backend mp`, the model in a worker process of
  its own, as every data-parallel replica and pipeline stage below runs it (vLLM's choice for
  them): what the executor alone changes;
- `dp2`: `--data-parallel-size 2`, two engine replicas (two model copies) behind vLLM's API
  servers and DP coordinator, each replica's MLX BLAS with as many threads as CPUs (the default:
  on 2 cores, 4 BLAS threads in all);
- `dp2_1thread`: the same with `VLLM_METAL_CPU_THREADS=1`, one BLAS thread per replica, so the
  two replicas together use the threads `one` does;
- `pp2`: `--pipeline-parallel-size 2`, two worker processes of half the layers each, hidden
  states handed over vLLM's pipeline group (gloo) every step.

They run in phases (`phases_of`): `one` starts first and stays up; each other server runs beside
it in a phase of its own (memory holds one model copy and a replicated server's two, not every
server's at once). In a phase this process sends both servers the same rounds in turn (the
order reversed every other round), each once the other server's processes are idle again
(`servers.round_robin`, which records the CPU seconds the idle one used meanwhile): one warm-up
round of each size, then `--c1-rounds` rounds of 1 request and `--c8-rounds` rounds of 8 requests
released together, streamed `/v1/completions` of `--input-len` random prompt ids, greedy,
`--output-len` tokens with EOS ignored. Every request has a prompt of its own; a round sends the
same prompts to both servers. Per request: TTFT (send -> first token), TPOT (first -> last token
over the tokens between); per round: output tok/s (its tokens / its wall time, first sent -> last
token).

Ratios are taken between the two servers of one phase, measured side by side: the machine is
shared, and figures of different phases or runs do not compare (`one`'s figures in each phase
show how far they drift). In every phase the servers' greedy tokens are compared request by
request (`agreement`): parallelism must not change them.

    python -m bench.run parallel --out docs/benchmarks            # ~15 min on 2 cores
    python -m bench.run parallel --quick --out /tmp/parallel-quick  # tiny model: checks it

`--quick`: the tiny model, 8 tokens, one round of each size, `dp2` and `pp2` side by side in one
phase (the suite's own servers; their tokens compared with each other); `--quick --peers` runs
each beside `one`, with the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import servers
from bench.harness.servers import Server, round_robin, server_info, stop_all, wait_all_healthy
from bench.harness.stages import command_line, kv_bytes, runs_peers, suite_parser

SERVED = "bench"
STREAMS = (1, 8)
# name: (extra `vllm serve` arguments, environment, what it is)
SERVERS: dict[str, tuple[list[str], dict[str, str], str]] = {
    "one": ([], {}, "one engine process"),
    # The executor the replicas and stages below run under (the plugin's default for one
    # process is vLLM's in-process `uni`): what that alone changes.
    "one_mp": (["--distributed-executor-backend", "mp"], {},
               "one engine process, its model in a worker process (mp executor)"),
    "dp2": (["--data-parallel-size", "2"], {}, "two replicas, BLAS threads = CPUs each"),
    "dp2_1thread": (["--data-parallel-size", "2"], {"VLLM_METAL_CPU_THREADS": "1"},
                    "two replicas, one BLAS thread each"),
    "pp2": (["--pipeline-parallel-size", "2"], {}, "two pipeline stages"),
}  # fmt: skip
QUICK_SERVERS = ("dp2", "pp2")  # `one` is the peer (`--peers`)


def launch(name: str, model: Path, args: argparse.Namespace, kv: int, log: Path) -> Server:
    """Server `name` of `SERVERS` (not waited for)."""
    extra, env, _ = SERVERS[name]
    # Distinct prompts anyway; no server may skip work on one another phase sent before.
    common = ["--max-num-seqs", str(max(STREAMS)), "--no-enable-prefix-caching",
              "--uvicorn-log-level", "warning"]  # fmt: skip
    return servers.launch(model, log, backend="plugin", served_name=SERVED, dtype=args.dtype,
                          max_model_len=args.input_len + args.output_len + 16, kv_cache_bytes=kv,
                          extra_args=[*common, *extra], env=env)  # fmt: skip


def resident_bytes(server: Server) -> int:
    """Resident memory of a server's processes (API servers, coordinator, engines, workers)."""
    import psutil

    root = psutil.Process(server.process.pid)
    total = 0
    for proc in (root, *root.children(recursive=True)):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def complete(server: Server, prompt: list[int], max_tokens: int, timeout: float) -> dict[str, Any]:
    """One streamed greedy completion of `prompt`: its token ids and when they arrived."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    with server.post("/v1/completions", body, stream=True, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {response.text}{server.context()}")
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            for choice in json.loads(line[6:]).get("choices", []):
                new = choice.get("token_ids") or []
                times += [now] * len(new)
                ids += new
    if len(ids) != max_tokens:
        raise RuntimeError(f"{len(ids)} tokens streamed, {max_tokens} asked{server.context()}")
    return {
        "sent": sent,
        "last": times[-1],
        "ttft_ms": (times[0] - sent) * 1e3,
        "tpot_ms": (times[-1] - times[0]) / max(1, len(ids) - 1) * 1e3,
        "token_ids": ids,
    }


def send_round(server: Server, prompts: list[list[int]], max_tokens: int,
               timeout: float) -> dict[str, Any]:  # fmt: skip
    """The prompts as requests released together: each request's figures and the round's."""
    barrier = threading.Barrier(len(prompts))

    def one(prompt: list[int]) -> dict[str, Any]:
        barrier.wait()
        return complete(server, prompt, max_tokens, timeout)

    with ThreadPoolExecutor(len(prompts)) as pool:
        requests = list(pool.map(one, prompts))
    wall = max(r["last"] for r in requests) - min(r["sent"] for r in requests)
    return {"requests": requests, "wall_s": wall,
            "output_tok_s": sum(len(r["token_ids"]) for r in requests) / wall}  # fmt: skip


def case(n: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's figures at `n` streams over its measured rounds."""
    reqs = [r for rd in rounds for r in rd["requests"]]
    tpot = statistics.median(r["tpot_ms"] for r in reqs)
    return {
        "streams": n,
        "rounds": len(rounds),
        "median_tpot_ms": round(tpot, 2),
        # None where every token of a request came in one chunk (a tiny model on a busy host)
        "decode_tok_s": round(n * 1e3 / tpot, 3) if tpot > 0 else None,
        "output_tok_s": round(statistics.median(rd["output_tok_s"] for rd in rounds), 3),
        "median_ttft_ms": round(statistics.median(r["ttft_ms"] for r in reqs), 1),
        "round_s": [round(rd["wall_s"], 3) for rd in rounds],
        "server_cpu_s": [round(rd["cpu_s"], 2) for rd in rounds],
        "other_servers_cpu_s": [round(rd["other_cpu_s"], 2) for rd in rounds],
        "load_average_1m": [round(rd["load_1m"], 2) for rd in rounds],
    }


def agreement(tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    """Each server's greedy tokens of every measured request against the first server's: how
    many requests are identical and how many leading tokens each shares. Passed when every
    request's first token agrees: the benchmark model's random weights leave near-ties between
    its top two logits, and a BLAS with another thread count sums in another order, which may
    flip a later token (the suite's tests run the tiny model, whose tokens must be identical)."""

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    names = list(tokens)
    ref = names[0]
    out: dict[str, Any] = {"reference": ref, "requests": len(tokens[ref]), "servers": {}}
    for name in names[1:]:
        prefixes = [common(a, b) for a, b in zip(tokens[ref], tokens[name])]
        same = [a == b for a, b in zip(tokens[ref], tokens[name])]
        first = next((i for i, s in enumerate(same) if not s), None)
        out["servers"][name] = {
            "identical": sum(same),
            "first_token_equal": sum(p >= 1 for p in prefixes),
            "common_prefix_tokens": prefixes,
            "first_differing_request": first,
            "tokens": None if first is None else {ref: tokens[ref][first],
                                                  name: tokens[name][first]},
        }  # fmt: skip
    out["passed"] = all(s["first_token_equal"] == out["requests"]
                        for s in out["servers"].values())  # fmt: skip
    return out


def phases_of(names: list[str]) -> list[list[str]]:
    """The servers that run side by side, phase after phase: with `one` among `names`, each other
    server beside it in a phase of its own, `one` staying up throughout (the machine's memory
    holds one model copy and a replicated server's two, not every server's at once); without
    `one`, all of them in one phase."""
    others = [name for name in names if name != "one"]
    if "one" not in names:
        return [others]
    return [["one", name] for name in others] or [["one"]]


def phase_rounds(live: dict[str, Server], batches: dict[tuple[int, int], list[list[int]]],
                 args: argparse.Namespace, label: str) -> dict[str, Any]:  # fmt: skip
    """The warm-up and measured rounds (`batches`, keyed by streams and round, -1 the warm-up)
    sent to the servers of one phase in turn: the cases and the tokens' agreement."""
    calls: dict[int, dict[str, list[dict]]] = {n: {name: [] for name in live} for n in STREAMS}
    warmup: dict[str, list[float]] = {name: [] for name in live}
    for (n, k), batch in batches.items():
        tokens = 4 if k < 0 else args.output_len

        def send(name: str, batch: list[list[int]] = batch, tokens: int = tokens) -> dict:
            return send_round(live[name], batch, tokens, args.timeout)

        for name, r in round_robin(live, k + 1, send).items():
            if k < 0:
                warmup[name].append(round(r["wall_s"], 3))
                continue
            calls[n][name].append(r)
            tpot = statistics.median(q["tpot_ms"] for q in r["requests"])
            print(f"[parallel] {label}: c={n} {name}: {r['output_tok_s']:.2f} tok/s, "
                  f"TPOT {tpot:.1f} ms", flush=True)  # fmt: skip
    tokens = {name: [q["token_ids"] for n in STREAMS for rd in calls[n][name]
                     for q in rd["requests"]] for name in live}  # fmt: skip
    return {
        "servers": list(live),
        "warmup_s": warmup,
        "cases": {f"c{n}_{name}": case(n, calls[n][name]) for n in STREAMS for name in live},
        "agreement": agreement(tokens),
    }


def run(args: argparse.Namespace, names: list[str], model: Path, logs: Path) -> dict[str, Any]:
    from bench.harness.checkpoints import describe_model
    from bench.harness.servers import wait_group_gone
    from bench.harness.single_stream import make_prompts

    desc = describe_model(model)
    kv = kv_bytes(desc, args.input_len + args.output_len + 16, max(STREAMS))
    rounds = {1: args.c1_rounds, 8: args.c8_rounds}
    phases = phases_of(names)
    # Every request its own prompt, in every phase (`one` serves them all).
    plan = [(n, k) for n in STREAMS for k in range(-1, rounds[n])]  # -1: the warm-up round
    prompts = iter(make_prompts(len(phases) * sum(n for n, _ in plan), args.input_len, args.seed))

    launched: dict[str, Server] = {}
    ready: dict[str, dict[str, Any]] = {}
    live: dict[str, Server] = {}
    out_phases: dict[str, dict[str, Any]] = {}
    try:
        for phase in phases:
            label = "+".join(n for n in phase if n != "one") or "one"
            for name in [n for n in live if n not in phase]:
                live.pop(name).stop()
                wait_group_gone(launched[name].process.pid)
            new = {n: launch(n, model, args, kv, logs / f"server-{n}.log")
                   for n in phase if n not in live}  # fmt: skip
            print(f"[parallel] phase {label}: starting {', '.join(new)}", flush=True)
            launched.update(new)
            up, _ = wait_all_healthy(new, args.startup_timeout)
            for name, server in new.items():
                ready[name] = {**up[name], "resident_bytes": resident_bytes(server)}
            live.update(new)
            batches = {(n, k): [next(prompts) for _ in range(n)] for n, k in plan}
            out_phases[label] = phase_rounds({n: live[n] for n in phase}, batches, args, label)
    finally:
        stop_all(live)

    return {
        "model": desc,
        "kv_cache_memory_bytes": kv,
        "servers": {
            name: {
                **server_info(s, ready.get(name, {})),
                "what": SERVERS[name][2],
                "env": SERVERS[name][1],
            }
            for name, s in launched.items()
        },
        "phases": out_phases,
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios between servers of one phase (side by side): each server against `one` in
    aggregate output tok/s at 8 streams, and in TPOT (above 1: slower per token)."""
    big = max(STREAMS)
    ratios: dict[str, float | None] = {}
    for name in SERVERS:
        if name == "one":
            continue
        cs = report["phases"].get(name, {}).get("cases", {})

        def ratio(key: str, n: int, cs: dict = cs, name: str = name) -> float | None:
            x, y = cs.get(f"c{n}_{name}", {}).get(key), cs.get(f"c{n}_one", {}).get(key)
            return round(x / y, 3) if x and y else None

        ratios[f"{name}_vs_one_output_tok_s_c{big}"] = ratio("output_tok_s", big)
        for n in STREAMS:
            ratios[f"{name}_vs_one_tpot_c{n}"] = ratio("median_tpot_ms", n)
    pp = report["phases"].get("pp2", {}).get("cases", {})
    added = None
    if "c1_pp2" in pp and "c1_one" in pp:
        added = round(pp["c1_pp2"]["median_tpot_ms"] - pp["c1_one"]["median_tpot_ms"], 2)
    passed = all(p["agreement"]["passed"] for p in report["phases"].values())
    return {"ratios": ratios, "pp2_added_tpot_ms_c1": added, "agreement_passed": passed}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("parallel", __doc__, "tiny model, dp2 and pp2: checks the harness")
    p.add_argument("--size", default=None, help="benchmark checkpoint: 0.6b (tiny with --quick)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--servers", default=None, help=f"comma-separated subset of {list(SERVERS)}")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--c1-rounds", type=int, default=None, help="1-stream rounds: 3 (1 quick)")
    p.add_argument("--c8-rounds", type=int, default=None, help="8-stream rounds: 2 (1 quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.quick else "0.6b")
    args.output_len = args.output_len or (8 if args.quick else 64)
    args.c1_rounds = args.c1_rounds or (1 if args.quick else 3)
    args.c8_rounds = args.c8_rounds or (1 if args.quick else 2)
    if args.servers is not None:
        names = args.servers.split(",")
        if set(names) - set(SERVERS):
            p.error(f"unknown servers {sorted(set(names) - set(SERVERS))}; from {list(SERVERS)}")
    elif args.quick:
        names = (["one"] if runs_peers(args) else []) + list(QUICK_SERVERS)
    else:
        names = list(SERVERS)

    from bench.harness.checkpoints import write_model
    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("parallel-quick" if args.quick else "parallel")
    logs.mkdir(parents=True, exist_ok=True)
    machine = describe_machine_apart(logs)
    model = write_model(work / "models", args.size, args.dtype)
    result = run(args, names, model, logs)
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "servers": names,
            "dtype": args.dtype,
            "streams": list(STREAMS),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "c1_rounds": args.c1_rounds,
            "c8_rounds": args.c8_rounds,
            "command": command_line("parallel", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        **result,
    }
    report["summary"] = summarize(report)
    from bench.suites.parallel_report import write_report

    write_report(report, Path(args.out))
    if not report["summary"]["agreement_passed"]:
        print("[parallel] the servers' greedy tokens differ; see the report", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
