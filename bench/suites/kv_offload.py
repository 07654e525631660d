"""KV offload tiers: time to first token of a re-sent 8k-token prompt, recomputed vs loaded from
the host tier vs from the disk tier, in one run.

Model: random-weight Llama-style, 4 layers, hidden 768, MLP 2048, 12 query / 4 KV heads of 64,
32,000-row vocabulary, float32 (8 KiB of KV per token). Prompts: random ids, P and two others
(Q1, Q2) that evict it from a device KV pool holding 1.5 prompts (`kv_cache_memory_bytes`);
prefix caching on, prefill chunks of 2,048 tokens. Each engine is a `vllm.LLM` in a worker
process (`bench.harness.workers`' protocol, engine core forked), one request at a time,
max_tokens=1, greedy, after a 15-token warm-up request:

1. **recomputed** (no tiers): P (cold), then 5 times Q1, Q2, P: P is prefilled again;
2. **host**: the same with `kv_offloading_size` holding every prompt: P comes from the host tier;
3. **disk**: `VLLM_METAL_SSD_CACHE_DIR` on a fresh directory under `--work-dir`: P (cold), Q1,
   Q2, shut down; then 5 times: drop the block files from the page cache (`posix_fadvise`,
   checked with `fincore`), a new engine on the directory (empty host tier), P: from disk.

TTFT is vLLM's `first_token_latency`. Each re-sent P must hit its tier (`num_cached_tokens`, the
hit counters) and P's first token must be the same everywhere, or the run fails.

    python -m bench.run kv_offload --out docs/benchmarks                # ~8 min on 2 cores
    python -m bench.run kv_offload --quick --out /tmp/kv-offload-quick  # tiny model, checks the harness

`--quick`: the tests' tiny Llama, 512-token prompts, 2 re-sends per case; without `--peers` the
recomputed case (the baseline) is left out and the tiers take two engines: one with both tiers
serves P, Q1, Q2 and the re-sent P from the host tier while writing the disk tier, and one restart
reads P from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.stages import command_line, runs_peers, suite_parser
from bench.harness.workers import add_worker_arguments, reply_pipe

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (each worker is this module with --reply-fd).

DTYPE = "float32"
BLOCK = 16
CASES = ("recomputed", "host", "disk")
SHAPE = {"num_layers": 4, "hidden_size": 768, "intermediate_size": 2048, "num_heads": 12,
         "num_kv_heads": 4, "head_dim": 64}  # fmt: skip
VOCAB = 32000
WARMUP_TOKENS = 15  # no full block: never stored to a tier nor served from one
HOST_HIT, DISK_HIT = "vllm:kv_offload_host_hit_blocks", "vllm:kv_offload_disk_hit_blocks"
EXTERNAL_HIT = "vllm:external_prefix_cache_hits"
LOAD_TIME, LOAD_BYTES = "vllm:kv_offload_load_time", "vllm:kv_offload_load_bytes"
COUNTERS = (HOST_HIT, DISK_HIT, EXTERNAL_HIT, LOAD_TIME, LOAD_BYTES, "vllm:kv_offload_store_bytes")


def _counters(llm: Any) -> dict[str, float]:
    """The engine's counters above. `get_metrics` rounds every counter to an int, so the load
    time (seconds) is read from the Prometheus registry it reads."""
    from prometheus_client import REGISTRY

    out = {m.name: m.value for m in llm.get_metrics() if m.name in COUNTERS}
    out[LOAD_TIME] = sum(s.value for m in REGISTRY.collect() if m.name == LOAD_TIME
                         for s in m.samples if s.name.endswith("_total"))  # fmt: skip
    return out


def write_kv_model(work: Path, quick: bool, seed: int = 0) -> Path:
    """Write (or reuse) the benchmark checkpoint (`--quick`: the tests' tiny Llama)."""
    from vllm_metal.testing import tiny_models as tm

    shape = None if quick else SHAPE
    path = work / "models" / f"llama-{'tiny' if quick else '4x768-random'}-{DTYPE}"
    stamp = {"kind": "llama", "shape": shape, "vocab": None if quick else VOCAB, "seed": seed,
             "dtype": DTYPE, "format": 2}  # fmt: skip
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path  # reused as is: the disk tier keys its files on the weights' mtimes
    if quick:
        tm.write_tiny_model(path, "llama", dtype=DTYPE, seed=seed)
    else:
        from bench.harness.checkpoints import pad_tokenizer

        # The usual 0.02 init: logits spread enough that float32 noise cannot flip the argmax.
        tm.write_tiny_model(path, "llama", dtype=DTYPE, seed=seed, weight_std=0.02,
                            vocab_size=VOCAB, max_position_embeddings=16384, **SHAPE)  # fmt: skip
        pad_tokenizer(path / "tokenizer.json", VOCAB)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def worker(args: argparse.Namespace) -> int:
    """One `vllm.LLM`; `{"op": "generate", "prompt": NAME, "max_tokens"}` (JSON lines) on stdin,
    one JSON reply each on --reply-fd; `{"op": "quit"}` shuts the engine down."""
    engine = json.loads(args.engine)
    os.environ.update(engine.pop("env", {}))  # before vLLM reads its environment
    reply = reply_pipe(args.reply_fd)
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.inputs).read_text())
    started = time.perf_counter()
    llm = LLM(**engine)
    config = llm.llm_engine.vllm_config
    reply({"ready": True, "engine_start_s": round(time.perf_counter() - started, 2),
           "device_blocks": config.cache_config.num_gpu_blocks,
           "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens})  # fmt: skip
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        [out] = llm.generate([{"prompt_token_ids": prompts[cmd["prompt"]]}], params,
                             use_tqdm=False)  # fmt: skip
        wall = time.perf_counter() - t0
        counters = _counters(llm)
        m = out.metrics  # engine-core times: a request is "scheduled" once its load is in
        reply({"prompt": cmd["prompt"], "ttft_s": m.first_token_latency, "wall_s": wall,
               "wait_s": m.scheduled_ts - m.queued_ts, "compute_s": m.first_token_ts
               - m.scheduled_ts, "num_cached_tokens": out.num_cached_tokens,
               "token_ids": list(out.outputs[0].token_ids), "counters": counters})  # fmt: skip
    llm.llm_engine.engine_core.shutdown()  # drains the disk tier's writes
    reply({"bye": True})
    return 0


def session(
    name: str, engine: dict, prompts: list[str], inputs: Path, logs: Path, timeout: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start a worker, send it `prompts` one at a time, shut it down: its ready message and each
    request's figures with its counter deltas."""
    from bench.harness.workers import Worker

    w = Worker(name, "plugin", engine, inputs, logs / f"{name}.log", timeout,
               module="bench.suites.kv_offload")  # fmt: skip
    try:
        ready, replies, last = w.receive(), [], {}
        for prompt in prompts:
            r = w.call(op="generate", prompt=prompt, max_tokens=1)
            now = r.pop("counters")
            r["delta"] = {k: now.get(k, 0) - last.get(k, 0) for k in COUNTERS}
            replies.append(r)
            last = now
            print(f"[kv_offload] {name} {prompt}: TTFT {r['ttft_s']:.3f} s, "
                  f"{r['num_cached_tokens']} cached", flush=True)  # fmt: skip
    finally:
        w.close()
    return ready, replies


def drop_page_cache(files: list[Path]) -> dict[str, Any]:
    """Evict the files' pages from the page cache; bytes resident before and after (`fincore`)."""

    def resident() -> int | None:
        if not shutil.which("fincore"):
            return None
        total = 0
        for i in range(0, len(files), 500):
            out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, files[i:i + 500])],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            total += sum(int(x) for x in out.split())
        return total

    before = resident()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return {"resident_before": before, "resident_after": resident()}


def check(case: str, r: dict[str, Any], full: int) -> list[str]:
    """What is wrong with a re-sent P's figures for `case` (nothing when it hit its tier only)."""
    d = r["delta"]
    got = (r["num_cached_tokens"], d[HOST_HIT] * BLOCK, d[DISK_HIT] * BLOCK, d[EXTERNAL_HIT])
    want = {"recomputed": (0, 0, 0, 0), "host": (full, full, 0, full),
            "disk": (full, 0, full, full)}[case]  # fmt: skip
    what = "(cached, host-hit, disk-hit, external-hit tokens)"
    return [] if got == want else [f"{case}: {what} = {got}, want {want}"]


def run(args: argparse.Namespace, model: Path, work: Path, logs: Path) -> dict[str, Any]:
    from bench.harness.checkpoints import describe_model
    from bench.harness.single_stream import make_prompts

    desc = describe_model(model)
    n = args.input_len
    ids = make_prompts(4, n, args.seed)
    inputs = logs / "prompts.json"
    names = {"P": ids[0], "Q1": ids[1], "Q2": ids[2], "W": ids[3][:WARMUP_TOKENS]}
    inputs.write_text(json.dumps(names))
    block_bytes = BLOCK * desc["kv_bytes_per_token"]
    prompt_blocks = -(-n // BLOCK)
    host_gib = round(4 * prompt_blocks * block_bytes / 2**30 + 0.005, 2)  # room for every prompt
    base = {
        "model": str(model), "dtype": DTYPE, "seed": 0, "max_model_len": n + 64,
        "kv_cache_memory_bytes": int(1.5 * prompt_blocks) * block_bytes,
        "max_num_batched_tokens": min(2048, n), "max_num_seqs": 4,
        "enable_prefix_caching": True, "disable_log_stats": False,  # counters, metrics
        "env": {"VLLM_WORKER_MULTIPROC_METHOD": "fork"},  # the worker runs no MLX before it
    }  # fmt: skip
    disk_dir = Path(tempfile.mkdtemp(prefix="kv-offload-disk-", dir=work))
    engines = {
        "recomputed": base,
        "host": {**base, "kv_offloading_size": host_gib},
        "disk": {**base, "kv_offloading_size": host_gib,
                 "env": {**base["env"], "VLLM_METAL_SSD_CACHE_DIR": str(disk_dir)}},
    }  # fmt: skip
    cold: dict[str, dict] = {}
    starts: dict[str, list[float]] = {c: [] for c in CASES}
    drops: list[dict[str, Any]] = []
    info: dict[str, Any] = {}  # the engines' ready messages (the same pool in each)

    def run_one(case: str, name: str, prompts: list[str]) -> list[dict[str, Any]]:
        ready, replies = session(name, engines[case], prompts, inputs, logs, args.timeout)
        starts[case].append(ready["engine_start_s"])
        info.update(ready)
        return replies

    peers = runs_peers(args)
    cases = CASES if peers else ("host", "disk")
    resent: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        if peers:
            for case in ("recomputed", "host"):  # W, P, then (Q1, Q2, P) x repeats
                rs = run_one(case, case, ["W", "P", *["Q1", "Q2", "P"] * args.repeats])
                cold[case], resent[case] = rs[1], rs[4::3]
            cold["disk"] = run_one("disk", "disk_write", ["W", "P", "Q1", "Q2"])[1]
        else:  # one engine with both tiers: the host tier's figures while the disk is written
            rs = run_one("disk", "host_disk_write", ["W", "P", *["Q1", "Q2", "P"] * args.repeats])
            cold["host"] = cold["disk"] = rs[1]
            resent["host"] = rs[4::3]
            starts["host"] = starts["disk"][:]
        files = sorted(disk_dir.rglob("*.kvb"))
        disk_bytes = sum(f.stat().st_size for f in files)
        for k in range(args.repeats if peers else 1):
            drops.append(drop_page_cache(files))
            resent["disk"].append(run_one("disk", f"disk_read{k}", ["W", "P"])[1])
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)

    full = n // BLOCK * BLOCK  # every full block (vLLM recomputes the last token's logits)
    problems = [p for c in cases for r in resent[c] for p in check(c, r, full)]
    if len(files) != 3 * full // BLOCK:  # P, Q1 and Q2 written through
        problems.append(f"disk: {len(files)} block files, want {3 * full // BLOCK}")
    first = {c: sorted({r["token_ids"][0] for r in [cold[c], *resent[c]]}) for c in cases}
    if len({t for ts in first.values() for t in ts}) != 1:
        problems.append(f"P's first token differs between requests: {first}")
    out: dict[str, Any] = {}
    for c in cases:
        rs = resent[c]
        out[c] = {
            "cold_ttft_s": cold[c]["ttft_s"],
            "resent_ttft_s": [r["ttft_s"] for r in rs],
            "resent_wall_s": [r["wall_s"] for r in rs],
            "median_ttft_s": statistics.median(r["ttft_s"] for r in rs),
            # queued -> scheduled (the tier's load) and scheduled -> first token (the forward)
            "median_wait_s": statistics.median(r["wait_s"] for r in rs),
            "median_compute_s": statistics.median(r["compute_s"] for r in rs),
            # the transfer jobs themselves: submitted -> seen finished (vLLM's counter)
            "median_load_time_s": statistics.median(r["delta"][LOAD_TIME] for r in rs),
            "load_bytes": [r["delta"][LOAD_BYTES] for r in rs],
            "num_cached_tokens": [r["num_cached_tokens"] for r in rs],
            "counter_deltas": [r["delta"] for r in rs],
            "first_tokens": first[c],
            "engine_start_s": starts[c],
        }
    for c in cases:  # None where the baseline did not run (`--quick` without `--peers`)
        rec = out.get("recomputed", {}).get("median_ttft_s")
        out[c]["vs_recomputed"] = None if rec is None else out[c]["median_ttft_s"] / rec
    return {
        "model": desc,
        "engine": engines,
        "kv_bytes_per_prompt": prompt_blocks * block_bytes,
        "device_blocks": info["device_blocks"],
        "max_num_batched_tokens": info["max_num_batched_tokens"],
        "disk": {"files": len(files), "bytes": disk_bytes, "page_cache_drops": drops},
        "cases": out,
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("kv_offload", __doc__, "tiny Llama: checks the harness")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens: 8192 (512)")
    p.add_argument("--repeats", type=int, default=None, help="re-sends of P per case: 5 (2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker reply")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    add_worker_arguments(p)
    args = p.parse_args(argv)
    if args.reply_fd is not None:
        return worker(args)
    args.input_len = args.input_len or (512 if args.quick else 8192)
    args.repeats = args.repeats or (2 if args.quick else 5)

    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("kv-offload-quick" if args.quick else "kv-offload")
    logs.mkdir(parents=True, exist_ok=True)
    print("[kv_offload] machine", flush=True)
    machine = describe_machine_apart(logs)
    print("[kv_offload] checkpoint", flush=True)
    model = write_kv_model(work, args.quick, args.seed)
    result = run(args, model, work, logs)
    command = command_line("kv_offload", argv)
    report: dict[str, Any] = {
        "settings": {"quick": args.quick, "dtype": DTYPE, "input_len": args.input_len,
                     "repeats": args.repeats, "seed": args.seed, "command": command,
                     "total_seconds": round(time.perf_counter() - started, 1)},
        "machine": machine,
        **result,
    }  # fmt: skip
    from bench.suites.kv_offload_report import write_report

    write_report(report, Path(args.out))
    for problem in report["problems"]:
        print(f"[kv_offload] CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
