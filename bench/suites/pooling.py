"""Embedding throughput, `LLM.embed`: the plugin against vLLM's own CPU backend, one run.

Two models, both served for embeddings (`runner="pooling"`), random weights, written locally:

- **decoder**: the benchmark checkpoint of `bench/harness/checkpoints.py` (Qwen3-0.6B's shapes) in float32, a
  CausalLM served as an embedding model: vLLM's default for it, last-token pooling, normalized;
- **encoder**: a BERT-base-shaped `BertModel` (12 layers, hidden 768, 12 heads, MLP 3072, a
  30,522-row vocabulary, 109 M parameters) in sentence-transformers layout (mean pooling,
  Normalize), with the WordPiece tokenizer of `tests.fixtures.tiny_encoders`.

Each (model, backend) is one `vllm.LLM` in a worker process of its own (`VLLM_TARGET_DEVICE=cpu`
for vLLM's backend). Both workers of a model are started, then this process sends them the same
calls alternately (plugin, CPU, then CPU, plugin, ...), so the machine's drift falls on both alike
and each ratio is measured side by side. Batch 1: one input per `embed` call, median latency per
call -> inputs/s. Batch 32: 32 inputs in one call, median call -> inputs/s. Every input is ~128
tokens of fixed text, distinct per call and the same for both backends (prefix caching off); one
warm-up call of each batch size comes first, and each call starts once the previous call's worker
is idle again (vLLM's CPU worker keeps a core busy for ~1 s after a call returns). Both
backends' embeddings of one batch-32 call are compared (cosine per input >= 0.999), so the
figures are known to measure the same work.

    python -m bench.run pooling --out docs/benchmarks            # ~11 min on 2 cores
    python -m bench.run pooling --quick --out /tmp/pooling-quick # tiny models, checks the harness

`--quick`: the tiny decoder of `bench/harness/checkpoints.py`, the tiny `bert-embed` encoder of
`tiny_encoders`, 3 batch-1 calls and 1 batch-32 call per case, and `enforce_eager` on both
backends (vLLM's CPU backend then skips its torch.compile warm-up, most of its start-up there);
without `--peers` only the decoder on the plugin (one engine: every path of the suite but the
encoder's checkpoint and the agreement), with `--peers` both models on both backends.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.stages import command_line, runs_peers, suite_parser
from bench.harness.workers import Worker, close_all

# Nothing here imports the plugin or MLX at module level: the parent must not run MLX before it
# starts engines (the workers are `bench.harness.workers`).

MODELS = ("decoder", "encoder")
BACKENDS = ("plugin", "cpu")
BATCHES = (1, 32)
INPUT_TOKENS = 128
MIN_COSINE = 0.999
DTYPE = "float32"  # the plugin computes in float32 on MLX's CPU device; vLLM's CPU backend too
# BERT-base (bert-base-uncased's config.json); the tokenizer only uses its first 512 ids.
# (MLP 4 x hidden = 3072.)
BERT_BASE = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "vocab_size": 30522}
# Wide enough that different inputs give clearly different embeddings (transformers' 0.02 makes
# every input look alike), narrow enough that 12 layers of attention do not saturate:
# ~1.4 / sqrt(hidden).
BERT_WEIGHT_STD = 0.05


def cases() -> list[dict[str, Any]]:
    return [
        {"name": f"{m}_b{b}_{be}", "model": m, "batch": b, "backend": be}
        for m in MODELS
        for b in BATCHES
        for be in BACKENDS
    ]


# ------------------------------------------------------------------------------ checkpoints


def write_encoder(out_dir: Path, quick: bool, seed: int = 0) -> Path:
    """Write (or reuse) the encoder checkpoint: `tiny_encoders`' tiny `bert-embed` with --quick,
    else the same layout (tokenizer, sentence-transformers files) with BERT-base's shapes."""
    from tests.fixtures.tiny_encoders import write_tiny_encoder

    name = "bert-embed-tiny" if quick else "bert-base-random"
    path = Path(out_dir) / f"{name}-{DTYPE}"
    shape = None if quick else {**BERT_BASE, "weight_std": BERT_WEIGHT_STD}
    stamp = {"kind": "bert-embed", "shape": shape, "dtype": DTYPE, "seed": seed, "format": 2}
    stamp_file = path / "bench_model.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return path
    if quick:
        write_tiny_encoder(path, "bert-embed", dtype=DTYPE, seed=seed)
    else:
        write_tiny_encoder(path, "bert-embed", dtype=DTYPE, seed=seed, **BERT_BASE,
                           weight_std=BERT_WEIGHT_STD)  # fmt: skip
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return path


def write_checkpoints(work: Path, quick: bool, kinds: list[str]) -> dict[str, Path]:
    from bench.harness.checkpoints import write_model

    models = work / "models"
    write = {
        "decoder": lambda: write_model(models, "tiny" if quick else "0.6b", DTYPE),
        "encoder": lambda: write_encoder(models, quick),
    }
    return {kind: write[kind]() for kind in kinds}


def describe_checkpoint(path: Path) -> dict[str, Any]:
    """Architecture, shape and parameter count from config.json and the safetensors header."""
    from bench.harness.checkpoints import safetensors_sizes

    config = json.loads((path / "config.json").read_text())
    sizes = safetensors_sizes(path / "model.safetensors")
    return {
        "path": str(path),
        "name": path.name,
        "architecture": config["architectures"][0],
        "dtype": DTYPE,
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "vocab_size": config["vocab_size"],
        "num_parameters": sum(sizes.values()) // 4,
        "weight_bytes": sum(sizes.values()),
        "sentence_transformers": (path / "modules.json").is_file(),
    }


# ---------------------------------------------------------------------------------- inputs


def make_texts(model: Path, num: int, tokens: int, seed: int) -> list[str]:
    """``num`` distinct texts of about ``tokens`` tokens (special tokens included) for the
    model's tokenizer: runs of consecutive words of the tiny tokenizer's corpus, each from its own
    start (distinct, seeded), one word at a time until the count is reached."""
    from transformers import AutoTokenizer

    from vllm_metal.testing.tiny_tokenizer import _CORPUS

    tokenizer = AutoTokenizer.from_pretrained(model)
    words = _CORPUS.split()
    if num > len(words):
        raise ValueError(f"{num} inputs asked for, but the corpus has {len(words)} start words")
    texts = []
    for start in random.Random(seed).sample(range(len(words)), num):
        n = 0
        text = ""
        while len(tokenizer(text)["input_ids"]) < tokens:
            text = " ".join(words[(start + k) % len(words)] for k in range(n + 1))
            n += 1
        texts.append(text)
    return texts


# ------------------------------------------------------------------------------ engines


def engine_args(model: Path, kv_cache_bytes: int, max_model_len: int, eager: bool) -> dict:
    """The same `vllm.LLM` arguments for both backends."""
    batch = max(BATCHES)
    return {
        "model": str(model),
        "runner": "pooling",
        "dtype": DTYPE,
        "max_model_len": max_model_len,
        "max_num_seqs": batch,
        # One batch-32 call is one engine step on both backends.
        "max_num_batched_tokens": batch * max_model_len,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "enable_prefix_caching": False,  # distinct inputs anyway; no backend may skip work
        "enforce_eager": eager,
        "seed": 0,
    }


# ---------------------------------------------------------------------------- one model


def _cosines(a_path: Path, b_path: Path) -> dict[str, Any]:
    import numpy as np

    a, b = np.load(a_path).astype(np.float64), np.load(b_path).astype(np.float64)
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    paired = (a * b).sum(axis=1)
    cross = a @ a.T  # different inputs on the plugin: how alike the model makes them
    off = cross[~np.eye(len(a), dtype=bool)]
    return {
        "inputs": len(a),
        "min_cosine": float(paired.min()),
        "mean_cosine": float(paired.mean()),
        "max_abs_diff": float(np.abs(a - b).max()),
        "cross_input_cosine_mean": float(off.mean()) if off.size else None,
        "cross_input_cosine_max": float(off.max()) if off.size else None,
        "min_required": MIN_COSINE,
        "passed": bool(paired.min() >= MIN_COSINE),
    }


def run_model(kind: str, path: Path, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Both backends' workers for one model, their calls alternated; the cases and the check
    (the plugin's alone and no check under `--quick` without `--peers`)."""
    backends = BACKENDS if runs_peers(args) else ("plugin",)
    b1_calls, b32_calls = args.b1_calls, args.b32_calls
    big = max(BATCHES)
    warm = [1, big]
    num_texts = sum(warm) + b1_calls + big * b32_calls
    texts = make_texts(path, num_texts, INPUT_TOKENS, args.seed)
    inputs = logs / f"{kind}_inputs.json"
    inputs.write_text(json.dumps(texts))
    max_model_len = INPUT_TOKENS + 32
    if kind == "decoder":
        from bench.harness.checkpoints import describe_model
        from bench.harness.stages import kv_bytes

        kv = kv_bytes(describe_model(path), max_model_len, big)
    else:
        kv = 64 << 20  # an encoder-only model has no KV cache; the argument must still be there
    engine = engine_args(path, kv, max_model_len, eager=args.quick)

    print(f"[pooling] {kind}: starting {', '.join(backends)}", flush=True)
    started = time.perf_counter()
    workers = {be: Worker(f"{kind}_{be}", be, engine, inputs, logs / f"{kind}_{be}.log",
                          args.timeout) for be in backends}  # fmt: skip
    try:
        ready = {be: w.receive() for be, w in workers.items()}
        both_ready_s = time.perf_counter() - started
        nxt = 0

        def take(n: int) -> int:
            nonlocal nxt
            nxt += n
            return nxt - n

        def round_robin(n: int, k: int, save: dict[str, str] | None = None) -> dict[str, dict]:
            """Call k: the same n inputs on both backends, the first backend alternating; each
            call starts once the previous one's worker is idle."""
            start = take(n)
            order = backends if k % 2 == 0 else backends[::-1]
            out = {}
            for be in order:
                out[be] = workers[be].call(op="embed", start=start, n=n, save=(save or {}).get(be))
                out[be]["busy_after_s"] = workers[be].settle()
            return out

        for n in warm:
            for be, r in round_robin(n, 0).items():
                ready[be].setdefault("warmup_s", []).append(round(r["seconds"], 3))
        calls: dict[int, dict[str, list[dict]]] = {b: {be: [] for be in backends} for b in BATCHES}
        print(f"[pooling] {kind}: {b1_calls} batch-1 calls per backend", flush=True)
        for k in range(b1_calls):
            for be, r in round_robin(1, k).items():
                calls[1][be].append(r)
        print(f"[pooling] {kind}: {b32_calls} batch-{big} calls per backend", flush=True)
        saved = {be: str(logs / f"{kind}_{be}_embeddings.npy") for be in backends}
        for k in range(b32_calls):
            for be, r in round_robin(big, k, saved if k == 0 else None).items():
                calls[big][be].append(r)
    finally:
        close_all(list(workers.values()))
    from bench.harness.stages import blas_log_lines

    out_cases: dict[str, dict[str, Any]] = {}
    for b in BATCHES:
        for be in backends:
            rs = calls[b][be]
            secs = [r["seconds"] for r in rs]
            tokens = [t for r in rs for t in r["tokens"]]
            med = statistics.median(secs)
            out_cases[f"{kind}_b{b}_{be}"] = {
                "model": kind,
                "batch": b,
                "backend": be,
                "calls": len(secs),
                "call_s": [round(s, 4) for s in secs],
                "median_call_s": med,
                "inputs_per_s": b / med,
                "tokens_per_s": b / med * statistics.mean(tokens),
                "tokens_per_input": {
                    "min": min(tokens),
                    "mean": statistics.mean(tokens),
                    "max": max(tokens),
                },
                # How long the worker's processes stayed busy after its calls returned.
                "busy_after_call_s": statistics.median(r["busy_after_s"] for r in rs),
                "embedding_dim": rs[0]["dim"],
            }
    token_lists = {be: [t for b in BATCHES for r in calls[b][be] for t in r["tokens"]]
                   for be in backends}  # fmt: skip
    check = None  # vLLM CPU not measured
    if "cpu" in backends:
        check = _cosines(Path(saved["plugin"]), Path(saved["cpu"]))
        check["same_token_counts"] = token_lists["plugin"] == token_lists["cpu"]
        check["passed"] = check["passed"] and check["same_token_counts"]
    worker_info = {}
    for be, w in workers.items():
        text = w.log.read_text(encoding="utf-8", errors="replace")
        blas = blas_log_lines(text)
        # vLLM's CPU worker binds its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND=auto`).
        bound = re.search(r"core ids=\[([^\]]*)\]", text)
        worker_info[be] = {**ready[be], "log": str(w.log), "cpu_blas_logged": blas,
                           "omp_bound_cores": bound.group(1) if bound else None}  # fmt: skip
    return {
        "model": describe_checkpoint(path),
        "engine": engine,
        "workers": worker_info,
        "both_ready_s": round(both_ready_s, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "cases": out_cases,
        "agreement": check,
    }


# ------------------------------------------------------------------------------- the whole run


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    cs = report["cases"]
    ratios = {}
    for m in MODELS:
        for b in BATCHES:
            p, c = cs.get(f"{m}_b{b}_plugin"), cs.get(f"{m}_b{b}_cpu")
            if p and c:
                ratios[f"{m}_b{b}_plugin_vs_cpu"] = round(p["inputs_per_s"] / c["inputs_per_s"], 3)
    batching = {}
    for m in MODELS:
        for be in BACKENDS:
            one, big = cs.get(f"{m}_b1_{be}"), cs.get(f"{m}_b{max(BATCHES)}_{be}")
            if one and big:
                batching[f"{m}_{be}"] = round(big["inputs_per_s"] / one["inputs_per_s"], 2)
    checks = {m: a["passed"] for m in report["models"]
              if (a := report["models"][m]["agreement"]) is not None}  # fmt: skip
    return {"ratios": ratios, "batch32_vs_batch1": batching, "agreement_passed": checks}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("pooling", __doc__, "tiny models: checks the harness")
    p.add_argument("--b1-calls", type=int, default=None, help="batch-1 calls per case: 12 (3)")
    p.add_argument("--b32-calls", type=int, default=None, help="batch-32 calls per case: 2 (1)")
    p.add_argument("--models", default=None,
                   help="comma-separated subset of decoder,encoder: both (decoder with --quick, "
                   "no --peers)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker reply")
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.b1_calls is None:
        args.b1_calls = 3 if args.quick else 12
    if args.b32_calls is None:
        args.b32_calls = 1 if args.quick else 2
    if args.models is None:
        args.models = ",".join(MODELS) if runs_peers(args) else "decoder"
    kinds = [m for m in args.models.split(",") if m]
    if set(kinds) - set(MODELS):
        p.error(f"unknown models {sorted(set(kinds) - set(MODELS))}; choose from {MODELS}")

    from bench.harness.stages import describe_machine_apart

    started = time.perf_counter()
    work = Path(args.work_dir)
    logs = work / ("pooling-quick" if args.quick else "pooling")
    logs.mkdir(parents=True, exist_ok=True)
    print("[pooling] machine", flush=True)
    machine = describe_machine_apart(logs)
    paths = write_checkpoints(work, args.quick, kinds)
    models = {kind: run_model(kind, paths[kind], args, logs) for kind in kinds}
    report: dict[str, Any] = {
        "settings": {
            "quick": args.quick,
            "dtype": DTYPE,
            "input_tokens": INPUT_TOKENS,
            "batches": list(BATCHES),
            "b1_calls": args.b1_calls,
            "b32_calls": args.b32_calls,
            "seed": args.seed,
            "command": command_line("pooling", argv),
            "total_seconds": round(time.perf_counter() - started, 1),
        },
        "machine": machine,
        "models": {k: {kk: v for kk, v in m.items() if kk != "cases"} for k, m in models.items()},
        "cases": {name: c for m in models.values() for name, c in m["cases"].items()},
    }
    report["summary"] = summarize(report)
    from bench.suites.pooling_report import write_report

    write_report(report, Path(args.out))
    ok = all(report["summary"]["agreement_passed"].values())
    if not ok:
        print("[pooling] the backends' embeddings disagree; see the report", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
